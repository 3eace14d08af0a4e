"""The prompt data source on real files read by `datasets`, tokenized by the tiny checkpoint's tokenizer."""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import datasets
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint
from miles.backends.training_utils.batching.sample import Sample, SampleStatus
from miles.rollout.data_source import (
    DataSourceConfig,
    PromptDataset,
    RolloutDataSource,
    num_rollouts_for_epochs,
)

SIZES = (1, 2, 3, 5, 8)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    checkpoint = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")
    return AutoTokenizer.from_pretrained(checkpoint)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def numbered_rows(n):
    return [{"input": f"prompt {i}", "label": str(i)} for i in range(n)]


def load(path, tokenizer, *, labels_required=False, context_length=None, **overrides):
    config = DataSourceConfig(prompt_data=str(path), **overrides)
    return PromptDataset(
        config, tokenizer, labels_required=labels_required, context_length=context_length
    )


@pytest.fixture(scope="module")
def sized_datasets(tmp_path_factory, tokenizer):
    """One dataset per size in SIZES, rows "prompt 0", "prompt 1", ...: built once per module."""
    folder = tmp_path_factory.mktemp("sized")
    return {n: load(write_jsonl(folder / f"{n}.jsonl", numbered_rows(n)), tokenizer) for n in SIZES}


def source_for(dataset, n_samples_per_prompt=1, **overrides):
    config = dataclasses.replace(dataset.config, **overrides)
    return RolloutDataSource(dataset, config, n_samples_per_prompt=n_samples_per_prompt)


def served_prompts(groups):
    return [group[0].prompt for group in groups]


def describe(groups):
    """Everything a consumer can observe about served groups, as comparable values."""
    return [
        [
            (s.group_index, s.index, s.prompt, list(s.tokens), s.response_length, s.status)
            for s in group
        ]
        for group in groups
    ]


# --- reading and rendering ------------------------------------------------------------------------


def test_jsonl_rows_become_records_with_token_ids_label_and_metadata(tmp_path, tokenizer):
    rows = [
        {"input": "What is 1+1?", "label": "2", "metadata": {"source": "gsm", "level": 1}},
        {"input": "Name a colour.", "label": "red", "metadata": {"source": "quiz", "level": 2}},
    ]
    dataset = load(write_jsonl(tmp_path / "data.jsonl", rows), tokenizer)

    assert len(dataset) == 2 and dataset.dropped == 0
    first = dataset[0]
    assert first.prompt == "What is 1+1?"
    assert first.prompt_ids == tokenizer("What is 1+1?")["input_ids"]
    assert tokenizer.decode(first.prompt_ids) == "What is 1+1?"
    assert first.label == "2"
    assert first.metadata == {"source": "gsm", "level": 1}
    assert dataset[1].metadata == {"source": "quiz", "level": 2}


def test_parquet_and_json_array_files_read_the_same_as_jsonl(tmp_path, tokenizer):
    rows = [{"input": f"q{i}", "label": f"a{i}", "metadata": {"k": i}} for i in range(4)]
    parquet = tmp_path / "data.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    array = tmp_path / "data.json"
    array.write_text(json.dumps(rows))

    expected = load(write_jsonl(tmp_path / "data.jsonl", rows), tokenizer)
    for path in (parquet, array):
        got = load(path, tokenizer)
        assert [got[i] for i in range(len(got))] == [expected[i] for i in range(4)]


def test_chat_template_renders_messages_and_wraps_plain_strings_as_a_user_turn(tmp_path, tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi?"},
    ]
    chat = load(
        write_jsonl(tmp_path / "chat.jsonl", [{"input": messages, "label": "x"}]),
        tokenizer,
        apply_chat_template=True,
    )
    plain = load(
        write_jsonl(tmp_path / "plain.jsonl", [{"input": "Hi?", "label": "x"}]),
        tokenizer,
        apply_chat_template=True,
    )

    assert chat[0].prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert plain[0].prompt == "<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n"
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    # The template's markers are single special tokens, and nothing else is added around them.
    assert plain[0].prompt_ids[0] == im_start
    assert plain[0].prompt_ids == tokenizer(plain[0].prompt, add_special_tokens=False)["input_ids"]


def test_template_variables_and_a_template_file_shape_the_prompts(tmp_path, tokenizer):
    template = tmp_path / "chat.jinja"
    template.write_text(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}(no thinking){% endif %}"
    )
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"input": "Hi?", "label": "x"}])
    quiet = load(rows, tokenizer, apply_chat_template=True, chat_template_path=str(template),
                 apply_chat_template_kwargs={"enable_thinking": False})  # fmt: skip
    assert quiet[0].prompt == "[user] Hi?\n(no thinking)"
    assert quiet[0].prompt_ids == tokenizer.encode(quiet[0].prompt, add_special_tokens=False)
    default = load(rows, tokenizer, apply_chat_template=True, chat_template_path=str(template))
    assert default[0].prompt == "[user] Hi?\n"
    # The tokenizer's own template with the same variables: unchanged by them (it reads none).
    own = load(rows, tokenizer, apply_chat_template=True,
               apply_chat_template_kwargs={"enable_thinking": False})  # fmt: skip
    assert own[0].prompt == "<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n"


def test_rows_keep_their_messages_and_tools_for_multi_turn_rollouts(tmp_path, tokenizer):
    from miles.rollout.data_source import RolloutDataSource

    rows = [{"input": "2+3?", "label": "5", "tools": ["add"]},
            {"input": [{"role": "user", "content": "hi"}], "label": "x", "tools": []}]  # fmt: skip
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    dataset = load(path, tokenizer, apply_chat_template=True, tool_key="tools")
    assert dataset[0].messages == [{"role": "user", "content": "2+3?"}] and dataset[0].tools == [
        "add"
    ]
    config = DataSourceConfig(prompt_data=str(path), apply_chat_template=True, tool_key="tools",
                              rollout_shuffle=False)  # fmt: skip
    (first, second) = RolloutDataSource(dataset, config, n_samples_per_prompt=2).get_samples(2)
    assert [s.metadata["tools"] for s in first] == [["add"], ["add"]]
    assert (
        second[0].messages == [{"role": "user", "content": "hi"}]
        and second[0].metadata["tools"] == []
    )
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"input": "q", "label": "x"}])
    assert load(plain, tokenizer)[0].messages is None  # plain text prompts have no messages
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"input": "q", "label": "x", "tools": "add"}])
    with pytest.raises(
        ValueError, match=r"bad.jsonl:1, column 'tools' \(--tool-key\) must be a list"
    ):
        load(bad, tokenizer, apply_chat_template=True, tool_key="tools")


def test_a_row_the_template_cannot_render_is_named(tmp_path, tokenizer):
    template = tmp_path / "strict.jinja"
    template.write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('no system messages here') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    rows = [{"input": "fine", "label": "x"},
            {"input": [{"role": "system", "content": "s"}], "label": "x"}]  # fmt: skip
    with pytest.raises(ValueError, match=r"rows.jsonl:2.*no system messages here"):
        load(write_jsonl(tmp_path / "rows.jsonl", rows), tokenizer,
             apply_chat_template=True, chat_template_path=str(template))  # fmt: skip


def test_chat_messages_without_apply_chat_template_are_refused(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"input": [{"role": "user", "content": "Hi"}]}])
    with pytest.raises(ValueError, match=r"chat\.jsonl:1.*--apply-chat-template"):
        load(path, tokenizer, label_key=None)


def test_custom_label_and_metadata_keys_and_non_string_labels(tmp_path, tokenizer):
    rows = [{"question": "q", "answer": 42, "extra": {"id": "a"}}]
    path = write_jsonl(tmp_path / "data.jsonl", rows)

    record = load(path, tokenizer, input_key="question", label_key="answer", metadata_key="extra")[
        0
    ]
    assert (record.prompt, record.label, record.metadata) == ("q", "42", {"id": "a"})

    unlabelled = load(path, tokenizer, input_key="question", label_key=None, metadata_key=None)[0]
    assert (unlabelled.label, unlabelled.metadata) == (None, {})


def test_default_metadata_column_may_be_absent_but_a_named_one_must_exist(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "data.jsonl", numbered_rows(2))
    assert load(path, tokenizer)[1].metadata == {}
    with pytest.raises(ValueError, match=r"--metadata-key 'info'.*\['input', 'label'\]"):
        load(path, tokenizer, metadata_key="info")


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"input_key": "prompt"}, r"--input-key 'prompt' is not a column.*\['input', 'label'\]"),
        ({"label_key": "answer"}, r"--label-key 'answer' is not a column.*\['input', 'label'\]"),
    ],
)
def test_missing_column_errors_list_the_columns(tmp_path, tokenizer, overrides, pattern):
    path = write_jsonl(tmp_path / "data.jsonl", numbered_rows(2))
    with pytest.raises(ValueError, match=pattern):
        load(path, tokenizer, **overrides)


@pytest.mark.parametrize(
    ("inputs", "bad_row"),
    [
        (["fine", None, "fine"], 1),
        ([["a", "b"], ["c"]], 0),
        ([[{"role": "user", "content": "ok"}], [{"role": "user"}]], 1),
        (["fine", ""], 1),
    ],
)
def test_rows_whose_input_is_not_a_prompt_are_named_by_file_line(
    tmp_path, tokenizer, inputs, bad_row
):
    path = write_jsonl(tmp_path / "data.jsonl", [{"input": value} for value in inputs])
    with pytest.raises(ValueError, match=rf"data\.jsonl:{bad_row + 1}\b"):  # lines count from 1
        load(path, tokenizer, label_key=None, apply_chat_template=isinstance(inputs[0], list))


def test_line_numbers_are_the_files_own_with_blank_lines_counted(tmp_path, tokenizer):
    path = tmp_path / "data.jsonl"
    path.write_text('{"input": "a", "label": "1"}\n\n\n{"input": "b"}\n')
    with pytest.raises(ValueError, match=r"data\.jsonl:4: no label \(column 'label'\)"):
        load(path, tokenizer, labels_required=True)
    array = tmp_path / "data.json"
    array.write_text(json.dumps([{"input": "a", "label": "1"}, {"input": "b", "label": None}]))
    with pytest.raises(ValueError, match=r"data\.json row 2: no label"):
        load(array, tokenizer, labels_required=True)
    assert len(load(path, tokenizer)) == 2  # a reward that reads no label: the row is fine


def test_a_json_error_names_the_line_that_broke(tmp_path, tokenizer):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"input": "a"}\n\n{"input": "b"}\n{"input": \n{"input": "c"}\n')
    with pytest.raises(ValueError, match=r"cannot read it as json: line 4: "):
        load(broken, tokenizer)


def test_prompts_that_fill_the_context_are_dropped_and_counted_or_refused_when_strict(
    tmp_path, tokenizer, caplog
):
    rows = [{"input": "x" * n, "label": str(n)} for n in (3, 12, 5, 30)]
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="miles.rollout"):
        dataset = load(path, tokenizer, context_length=10)  # room for 9 prompt tokens
    assert [dataset[i].label for i in range(len(dataset))] == ["3", "5"]
    assert dataset.dropped_by == {"the model's context": 2}
    assert "dropped 2 of 4 prompts" in caplog.text and "--rollout-max-prompt-len" in caplog.text
    with pytest.raises(
        ValueError, match=r"data\.jsonl:2: the prompt has 12 tokens, over the model's context \(9\)"
    ):
        load(path, tokenizer, context_length=10, strict_data=True)
    with pytest.raises(ValueError, match=r"data\.jsonl:4: .* over --rollout-max-prompt-len 20"):
        load(path, tokenizer, rollout_max_prompt_len=20, strict_data=True)


def test_length_filter_drops_long_prompts_and_logs_how_many(tmp_path, tokenizer, caplog):
    rows = [{"input": "x" * n, "label": str(n)} for n in (3, 20, 8, 9, 1)]
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="miles.rollout"):
        dataset = load(path, tokenizer, rollout_max_prompt_len=8)

    assert dataset.dropped == 2
    assert [dataset[i].label for i in range(len(dataset))] == ["3", "8", "1"]
    assert "dropped 2 of 5 prompts" in caplog.text and "--rollout-max-prompt-len 8" in caplog.text


def test_a_filter_that_drops_every_prompt_says_how_many_were_dropped(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "data.jsonl", [{"input": "long prompt"}] * 3)
    with pytest.raises(
        ValueError, match=r"all 3 rows were dropped \(3 by --rollout-max-prompt-len 2"
    ):
        load(path, tokenizer, label_key=None, rollout_max_prompt_len=2)


def test_bad_paths_and_settings_are_refused_naming_the_flag(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"--prompt-data .*\.csv"):
        DataSourceConfig(prompt_data=str(tmp_path / "data.csv"))
    with pytest.raises(FileNotFoundError, match="--prompt-data"):
        load(tmp_path / "absent.jsonl", tokenizer)
    with pytest.raises(ValueError, match="--n-samples-per-prompt"):
        source_for(load(write_jsonl(tmp_path / "one.jsonl", numbered_rows(1)), tokenizer), 0)
    with pytest.raises(ValueError, match="--rollout-max-prompt-len"):
        DataSourceConfig(prompt_data="x.jsonl", rollout_max_prompt_len=0)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"--prompt-data .* no rows"):
        load(empty, tokenizer)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"input": "a"}\n{"input": \n')
    with pytest.raises(ValueError, match=r"--prompt-data .*cannot read it as json"):
        load(broken, tokenizer)


# --- serving --------------------------------------------------------------------------------------


def test_groups_hold_fresh_samples_with_run_wide_indices(tmp_path, tokenizer):
    rows = [{"input": "q", "label": "a", "metadata": {"tags": ["t"]}}]
    dataset = load(write_jsonl(tmp_path / "data.jsonl", rows), tokenizer)
    source = source_for(dataset, n_samples_per_prompt=3)

    groups = source.get_samples(2) + source.get_samples(1)
    assert [[(s.group_index, s.index) for s in g] for g in groups] == [
        [(0, 0), (0, 1), (0, 2)],
        [(1, 3), (1, 4), (1, 5)],
        [(2, 6), (2, 7), (2, 8)],
    ]
    sample = groups[0][0]
    assert (sample.prompt, sample.tokens, sample.response_length, sample.label) == (
        "q",
        dataset[0].prompt_ids,
        0,
        "a",
    )
    # Rollouts fill samples in place: no sample may share a list with another or with the record.
    sample.tokens.append(7)
    sample.metadata["tags"].append("u")
    assert groups[0][1].tokens == dataset[0].prompt_ids == [ord("q")]
    assert groups[0][1].metadata == dataset[0].metadata == {"tags": ["t"]}
    assert source.get_samples(0) == []


def test_every_epoch_serves_every_prompt_exactly_once(sized_datasets):
    dataset = sized_datasets[5]
    source = source_for(dataset)
    stream = []
    for _ in range(7):  # 21 prompts in batches of 3: epochs 0-3 full, epoch 4 one prompt in
        stream += served_prompts(source.get_samples(3))

    everything = sorted(f"prompt {i}" for i in range(5))
    for epoch in range(4):
        assert sorted(stream[epoch * 5 : (epoch + 1) * 5]) == everything
    assert (source.epoch, source.epoch_position) == (4, 1)


def test_shuffle_is_seeded_and_changes_every_epoch(sized_datasets):
    dataset = sized_datasets[8]

    def epochs(source, n=3):
        return [served_prompts(source.get_samples(8)) for _ in range(n)]

    seeded = epochs(source_for(dataset, rollout_seed=7))
    assert seeded == epochs(source_for(dataset, rollout_seed=7))
    assert seeded[0] != seeded[1] != seeded[2]
    assert seeded != epochs(source_for(dataset, rollout_seed=8))
    in_order = [f"prompt {i}" for i in range(8)]
    assert epochs(source_for(dataset, rollout_shuffle=False)) == [in_order] * 3


def test_groups_given_back_are_served_first_in_order_and_survive_save_and_load(
    sized_datasets, tmp_path
):
    dataset = sized_datasets[3]
    source = source_for(dataset, n_samples_per_prompt=2)
    first, second = source.get_samples(2)
    first[0].tokens += [5, 6]
    first[0].response_length = 2
    first[0].status = SampleStatus.ABORTED
    first[0].metadata["turn"] = 1
    source.add_samples([second, first])

    state_file = tmp_path / "state" / "data_source.json"
    source.save(state_file)
    resumed = source_for(dataset, n_samples_per_prompt=2)
    resumed.load(state_file)

    served = source.get_samples(3)
    assert served[0] is second and served[1] is first
    assert served[2][0].group_index == 2
    again = resumed.get_samples(3)
    assert [[dataclasses.asdict(s) for s in g] for g in again] == [
        [dataclasses.asdict(s) for s in g] for g in served
    ]
    assert again[1][0].status is SampleStatus.ABORTED
    assert again[1][0].metadata == {"turn": 1}
    assert source.epoch_position == resumed.epoch_position == 3


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_resuming_from_state_dict_continues_the_uninterrupted_sequence(sized_datasets, data):
    size = data.draw(st.sampled_from(SIZES), label="dataset size")
    batches = data.draw(st.lists(st.integers(0, 7), min_size=1, max_size=8), label="batches")
    stop_after = data.draw(st.integers(0, len(batches)), label="calls before the restart")
    give_back_at = data.draw(st.none() | st.integers(0, len(batches) - 1), label="give back at")
    overrides = {
        "n_samples_per_prompt": data.draw(st.integers(1, 3)),
        "rollout_seed": data.draw(st.integers(0, 2**31)),
        "rollout_shuffle": data.draw(st.booleans()),
    }
    dataset = sized_datasets[size]

    def run(source, calls):
        seen = []
        for call in calls:
            groups = source.get_samples(batches[call])
            seen.append(describe(groups))
            if call == give_back_at and groups:
                # An aborted partial rollout: the last group goes back with a response started.
                groups[-1][0].tokens.append(1)
                groups[-1][0].response_length = 1
                groups[-1][0].status = SampleStatus.ABORTED
                source.add_samples(groups[-1:])
        return seen

    reference = source_for(dataset, **overrides)
    uninterrupted = run(reference, range(len(batches)))

    before = source_for(dataset, **overrides)
    seen = run(before, range(stop_after))
    state = json.loads(json.dumps(before.state_dict()))
    after = source_for(dataset, **overrides)
    after.load_state_dict(state)
    seen += run(after, range(stop_after, len(batches)))

    assert seen == uninterrupted
    assert after.state_dict() == reference.state_dict()


def test_state_from_another_seed_or_dataset_is_refused_and_changes_nothing(sized_datasets):
    source = source_for(sized_datasets[3])
    source.get_samples(2)
    state = source.state_dict()
    fresh = source_for(sized_datasets[3])

    with pytest.raises(ValueError, match=r"--rollout-seed 42.*has 43"):
        source_for(sized_datasets[3], rollout_seed=43).load_state_dict(state)
    with pytest.raises(ValueError, match=r"made with 3 prompts.*--prompt-data .* now gives 5"):
        source_for(sized_datasets[5]).load_state_dict(state)
    with pytest.raises(ValueError, match="--rollout-shuffle"):
        source_for(sized_datasets[3], rollout_shuffle=False).load_state_dict(state)
    with pytest.raises(ValueError, match="missing"):
        fresh.load_state_dict({"epoch": 0})
    assert fresh.state_dict() == source_for(sized_datasets[3]).state_dict()


def test_a_save_that_fails_midway_leaves_the_previous_file_intact(
    sized_datasets, tmp_path, monkeypatch
):
    source = source_for(sized_datasets[5])
    path = tmp_path / "data_source.json"
    source.save(path)
    saved = path.read_text()
    source.get_samples(2)

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        source.save(path)
    assert path.read_text() == saved
    assert json.loads(saved)["epoch_position"] == 0


def test_num_rollouts_for_epochs_counts_full_rollouts_only():
    assert num_rollouts_for_epochs(2, 10, 4) == 5
    assert num_rollouts_for_epochs(1, 10, 10) == 1
    with pytest.raises(ValueError, match=r"--num-epoch \(1\).*--rollout-batch-size \(8\)"):
        num_rollouts_for_epochs(1, 3, 8)


def test_add_samples_refuses_things_that_are_not_groups_of_samples(sized_datasets):
    source = source_for(sized_datasets[1])
    with pytest.raises(TypeError, match="non-empty list of Sample"):
        source.add_samples([[]])
    with pytest.raises(TypeError, match="non-empty list of Sample"):
        source.add_samples([Sample()])  # a flat list of samples, not groups


def test_every_bad_row_is_reported_at_once_up_to_twenty(tmp_path, tokenizer):
    rows = [{"input": "fine", "label": "1"}]
    rows += [{"input": "", "label": "1"}] * 3  # empty prompts
    rows += [{"input": "no label"}] * 2  # the reward reads the label
    rows += [{"input": "x", "label": "1", "metadata": "not a dict"}] * 20
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError) as info:
        load(path, tokenizer, labels_required=True)
    message = str(info.value)
    assert message.startswith(f"--prompt-data {path}: 25 rows cannot be used (the first 20)")
    lines = message.splitlines()[1:]
    assert len(lines) == 20
    assert lines[0].strip().startswith(f"--prompt-data {path}:2: renders to an empty prompt")
    assert lines[3].strip().startswith(f"--prompt-data {path}:5: no label")
    assert "must hold a dict" in lines[5]
