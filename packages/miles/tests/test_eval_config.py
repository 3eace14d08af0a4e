"""--eval-config: the file (YAML or JSON), each dataset's settings with the run's flags as the
fallback, every refusal naming the dataset, --eval-prompt-data as the same path, the CPU demo's
example, and a rollout manager evaluating each dataset with its own sampling and reward."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml
from transformers import AutoTokenizer

from miles.backends.training_utils.batching.sample import Sample
from miles.config import load_config
from miles.config.eval_config import EvalDatasetConfig
from miles.ray.rollout_manager import RolloutManager
from miles.rollout.train_data import eval_metrics

REPO = Path(__file__).resolve().parents[3]
BASE = ["--hf-checkpoint", "ckpt", "--prompt-data", "train.jsonl", "--rollout-batch-size", "4"]


@pytest.fixture
def data(tmp_path, monkeypatch) -> Path:
    """A prompt file; the launch directory is tmp_path, so datasets may name it relatively."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"input": "What is 2 + 3?", "label": "It is 5."}) + "\n")
    return path


def write(tmp_path: Path, document, name: str = "eval.yaml") -> Path:
    path = tmp_path / name
    if name.endswith(".json"):
        path.write_text(json.dumps(document))
    else:
        path.write_text(yaml.safe_dump(document))
    return path


def datasets(*flags: str) -> dict[str, EvalDatasetConfig]:
    config = load_config([*BASE, *flags])
    return {d.name: d for d in config.eval.eval_datasets}


def from_file(tmp_path: Path, entries: list[dict], *flags: str) -> dict[str, EvalDatasetConfig]:
    return datasets("--eval-config", str(write(tmp_path, {"datasets": entries})), *flags)


# -- reading the file ----------------------------------------------------------------------------


def test_a_yaml_file_sets_each_datasets_sampling_reward_keys_pass_at_k_and_interval(tmp_path, data):
    document = {"eval": {
        "defaults": {"max_response_len": 16, "top_p": 0.7},
        "datasets": [
            {"name": "aime", "path": "qa.jsonl", "n_samples_per_eval_prompt": 8,
             "temperature": 0.6, "top_k": 20, "rm_type": "f1", "pass_at_k": [8, 1, 4],
             "eval_interval": 3, "input_key": "question", "label_key": "answer",
             "metadata_key": None, "tool_key": "tools"},
            {"name": "math500", "path": str(data), "max_response_len": 32},
        ],
    }}  # fmt: skip
    found = datasets("--eval-config", str(write(tmp_path, document)))
    aime, math500 = found["aime"], found["math500"]
    assert list(found) == ["aime", "math500"]  # file order
    assert (aime.n_samples_per_eval_prompt, aime.temperature, aime.top_p, aime.top_k) == (8, 0.6, 0.7, 20)  # fmt: skip
    assert aime.max_response_len == 16 and math500.max_response_len == 32  # defaults, then own
    assert aime.reward.rm_type == "f1" and aime.pass_at_k == (1, 4, 8) and aime.eval_interval == 3
    assert (aime.data.input_key, aime.data.label_key) == ("question", "answer")
    assert (aime.data.metadata_key, aime.data.tool_key) == (None, "tools")
    assert aime.path == str(data)  # resolved against the launch directory
    assert aime.data.rollout_shuffle is False  # every prompt once, in file order


def test_a_json_file_may_key_its_datasets_by_name(tmp_path, data):
    document = {"datasets": {"easy": {"path": "qa.jsonl", "temperature": 0},
                             "hard": {"path": "qa.jsonl", "n_samples_per_eval_prompt": 4}}}  # fmt: skip
    found = datasets("--eval-config", str(write(tmp_path, document, "eval.json")))
    assert found["easy"].temperature == 0.0 and found["hard"].n_samples_per_eval_prompt == 4
    assert found["hard"].pass_at_k == (1, 4)


# -- the run's flags as the fallback -------------------------------------------------------------


def test_what_a_dataset_leaves_out_is_the_runs(tmp_path, data):
    run = ["--n-samples-per-eval-prompt", "3", "--eval-temperature", "0.5",
           "--eval-max-response-len", "7", "--rollout-top-p", "0.9", "--rollout-top-k", "5",
           "--input-key", "q", "--label-key", "a", "--rm-type", "exact_match",
           "--rm-timeout-s", "9", "--eval-interval", "2"]  # fmt: skip
    (dataset,) = from_file(tmp_path, [{"name": "d", "path": "qa.jsonl"}], *run).values()
    assert dataset.n_samples_per_eval_prompt == 3 and dataset.temperature == 0.5
    assert dataset.max_response_len == 7 and (dataset.top_p, dataset.top_k) == (0.9, 5)
    assert (dataset.data.input_key, dataset.data.label_key) == ("q", "a")
    assert dataset.reward.rm_type == "exact_match" and dataset.reward.rm_timeout_s == 9.0
    assert dataset.eval_interval == 2 and dataset.pass_at_k == (1, 3)


def test_without_eval_flags_a_dataset_samples_as_the_rollouts_do(tmp_path, data):
    run = ["--rollout-temperature", "0.8", "--rollout-max-response-len", "11"]
    (dataset,) = from_file(tmp_path, [{"name": "d", "path": "qa.jsonl"}], *run).values()
    assert (dataset.temperature, dataset.max_response_len) == (0.8, 11)
    assert dataset.n_samples_per_eval_prompt == 1 and dataset.eval_interval is None


def test_a_dataset_with_another_reward_type_drops_the_runs_type_settings(tmp_path, data):
    run = ["--rm-type", "custom", "--custom-rm-path", "run_rewards:score", "--rm-timeout-s", "5"]
    found = from_file(tmp_path, [
        {"name": "exact", "path": "qa.jsonl", "rm_type": "exact_match"},
        {"name": "own", "path": "qa.jsonl", "custom_rm_path": "eval_reward_fns:marked"},
        {"name": "runs", "path": "qa.jsonl"},
    ], *run)  # fmt: skip
    assert found["exact"].reward.rm_type == "exact_match"
    assert found["exact"].reward.custom_rm_path is None  # not the run's custom function
    assert found["exact"].reward.rm_timeout_s == 5.0  # how a reward is called stays the run's
    assert found["own"].reward.rm_type == "custom"  # a custom_rm_path says the type
    assert found["own"].reward.custom_rm_path == "eval_reward_fns:marked"
    assert found["runs"].reward == load_config([*BASE, *run]).reward


def test_eval_prompt_data_pairs_are_datasets_with_the_eval_flags(tmp_path, data):
    found = datasets(
        "--eval-prompt-data", "a", "qa.jsonl", "b", str(data), "--n-samples-per-eval-prompt", "4",
        "--eval-temperature", "0.3", "--rm-type", "exact_match", "--eval-interval", "5",
    )  # fmt: skip
    config = load_config([*BASE, "--eval-prompt-data", "a", "qa.jsonl", "--rm-type", "exact_match"])
    assert config.eval.eval_prompt_data == ["a", str(data)]  # recorded as before
    assert list(found) == ["a", "b"]
    for dataset in found.values():
        assert dataset.path == str(data) and dataset.n_samples_per_eval_prompt == 4
        assert dataset.temperature == 0.3 and dataset.max_response_len == 1024
        assert dataset.reward == config.reward and dataset.data.label_key == "label"
        assert dataset.pass_at_k == (1, 4) and dataset.eval_interval == 5


def test_a_dataset_is_due_on_its_interval_and_after_the_last_rollout(tmp_path, data):
    found = from_file(tmp_path, [
        {"name": "often", "path": "qa.jsonl", "eval_interval": 1},
        {"name": "ends", "path": "qa.jsonl"},
    ])  # fmt: skip
    assert [found["often"].due_after(r, 3) for r in range(3)] == [True, True, True]
    assert [found["ends"].due_after(r, 3) for r in range(3)] == [False, False, True]


# -- refusals: each names the dataset, the key or value, and the fix -----------------------------


def test_a_dataset_may_name_its_own_image_column(tmp_path, data):
    entries = [{"name": "charts", "path": "qa.jsonl", "multimodal_keys": {"image": "pics"}},
               {"name": "text", "path": "qa.jsonl"}]  # fmt: skip
    found = from_file(tmp_path, entries, "--apply-chat-template")
    assert found["charts"].data.image_key == "pics"
    assert found["text"].data.image_key is None


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"rm_typ": "f1"}, r"dataset 'd' has an unknown key 'rm_typ'; did you mean 'rm_type'\?"),
        ({"samples": 2}, r"dataset 'd' has an unknown key 'samples'; remove it \(known keys: "),
        ({"rm_type": "exact_matsh"},
         r"dataset 'd': rm_type 'exact_matsh' is not a reward type \(did you mean 'exact_match'\?\)"),
        ({"rm_type": "custom"}, r"dataset 'd': rm_type custom needs custom_rm_path"),
        ({"rm_url": "ftp://rm"}, r"dataset 'd': rm_url \('ftp://rm'\) must be an http:// or https://"),
        ({"group_rm": True, "rm_type": "f1"}, r"dataset 'd': group_rm \(True\) only applies to"),
        ({"rm_timeout_s": 0}, r"dataset 'd': rm_timeout_s \(0.0\) must be a positive number"),
        ({"n_samples_per_eval_prompt": 0},
         r"dataset 'd': n_samples_per_eval_prompt \(0\) must be at least 1; fix it"),
        ({"n_samples_per_eval_prompt": 2.5},
         r"dataset 'd', key 'n_samples_per_eval_prompt': expected an integer, got 2.5"),
        ({"temperature": -1}, r"dataset 'd': temperature \(-1.0\) must be >= 0 \(0 is greedy\)"),
        ({"temperature": "hot"}, r"dataset 'd', key 'temperature': expected a number, got 'hot'"),
        ({"top_p": 1.5}, r"dataset 'd': top_p \(1.5\) must be in \(0, 1\]"),
        ({"top_k": 0}, r"dataset 'd': top_k \(0\) must be -1 \(off\) or >= 1"),
        ({"max_response_len": 0}, r"dataset 'd': max_response_len \(0\) must be at least 1"),
        ({"eval_interval": 0}, r"dataset 'd': eval_interval \(0\) must be at least 1"),
        ({"pass_at_k": [1, 4]},
         r"dataset 'd': pass_at_k \(\[1, 4\]\) must list distinct k between 1 and "
         r"n_samples_per_eval_prompt \(2\); e\.g\. pass_at_k: \[1, 2\]"),
        ({"path": "missing.jsonl"},
         r"dataset 'd': path 'missing.jsonl' is not a file \(resolved against the launch "
         r"directory: .*missing.jsonl\); fix the path or create the file"),
        ({"path": "qa.txt"}, r"dataset 'd': path '.*qa.txt' must be a local .jsonl, .json, .parquet"),
        ({"label_key": None, "rm_type": "exact_match"},
         r"dataset 'd': rm_type exact_match compares answers with the label, but label_key is null"),
        ({"input_key": ""}, r"dataset 'd': input_key must name the column holding the prompts"),
        ({"multimodal_keys": {"video": "clips"}},
         r"dataset 'd': multimodal_keys maps 'video', which is not supported; supported media: "
         r"image"),
        ({"multimodal_keys": {"image": "pics"}},
         r"dataset 'd': multimodal_keys: images need the chat template .*--apply-chat-template"),
    ],
)  # fmt: skip
def test_a_bad_dataset_is_refused_naming_it_the_key_and_the_fix(tmp_path, data, entry, message):
    (tmp_path / "qa.txt").write_text("")
    entry = {"name": "d", "path": "qa.jsonl", "n_samples_per_eval_prompt": 2, **entry}
    with pytest.raises(ValueError, match=message):
        from_file(tmp_path, [entry])


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"datasets": [{"name": "d", "path": "qa.jsonl"}, {"name": "d", "path": "qa.jsonl"}]},
         r"dataset 'd' is listed twice; give each dataset its own name"),
        ({"datasets": [{"path": "qa.jsonl"}]}, r"dataset #1 needs a `name`"),
        ({"datasets": [{"name": "a/b", "path": "qa.jsonl"}]}, r"dataset #1 needs a `name` .*'a/b'"),
        ({"datasets": [{"name": "d"}]}, r"dataset 'd' has no `path`; name its prompt file"),
        ({"datasets": []}, r"lists no datasets: add `datasets:`"),
        ({"dataset": []}, r"the top level has an unknown key 'dataset'; did you mean 'datasets'\?"),
        ({"defaults": {"temprature": 1}, "datasets": [{"name": "d", "path": "qa.jsonl"}]},
         r"`defaults` has an unknown key 'temprature'; did you mean 'temperature'\?"),
        ({"datasets": ["qa.jsonl"]}, r"dataset #1 must be a mapping of settings"),
    ],
)  # fmt: skip
def test_a_bad_file_is_refused_naming_the_file_and_the_dataset(tmp_path, data, document, message):
    path = write(tmp_path, document)
    with pytest.raises(ValueError, match=rf"--eval-config {path}.*{message}"):
        datasets("--eval-config", str(path))


def test_a_file_that_is_not_yaml_or_json_or_not_there_is_refused(tmp_path, data):
    with pytest.raises(ValueError, match=r"--eval-config .*eval.toml must be a .yaml, .yml, .json"):
        datasets("--eval-config", str(tmp_path / "eval.toml"))
    with pytest.raises(ValueError, match=r"--eval-config .*absent.yaml: no such file"):
        datasets("--eval-config", "absent.yaml")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match=r"--eval-config .*broken.json is not valid JSON"):
        datasets("--eval-config", "broken.json")


def test_eval_config_and_eval_prompt_data_together_are_refused(tmp_path, data):
    path = write(tmp_path, {"datasets": [{"name": "d", "path": "qa.jsonl"}]})
    with pytest.raises(ValueError, match=r"--eval-config .* replaces --eval-prompt-data \(a "
                       r"qa.jsonl\); drop --eval-prompt-data and list those datasets in the file"):  # fmt: skip
        datasets("--eval-config", str(path), "--eval-prompt-data", "a", "qa.jsonl")


def test_eval_interval_is_refused_without_datasets_and_accepted_with_an_eval_config(tmp_path, data):
    with pytest.raises(ValueError, match="set --eval-prompt-data NAME PATH or --eval-config FILE"):
        datasets("--eval-interval", "2")
    path = write(tmp_path, {"datasets": [{"name": "d", "path": "qa.jsonl"}]})
    assert datasets("--eval-config", str(path), "--eval-interval", "2")["d"].eval_interval == 2


def test_eval_prompt_data_naming_a_dataset_twice_is_refused(data):
    with pytest.raises(ValueError, match="--eval-prompt-data names a dataset twice"):
        datasets("--eval-prompt-data", "a", "qa.jsonl", "a", "qa.jsonl")


# -- the CPU demo's example ----------------------------------------------------------------------


def test_the_cpu_demos_eval_config_loads_three_datasets(monkeypatch):
    monkeypatch.chdir(REPO)  # the demo runs from the repository root
    found = datasets("--eval-config", "examples/cpu_demo/eval_config.yaml")
    assert len(found) == 3
    assert len({d.reward.rm_type for d in found.values()}) > 1
    assert len({(d.n_samples_per_eval_prompt, d.temperature) for d in found.values()}) == 3


# -- metrics -------------------------------------------------------------------------------------


def test_eval_metrics_report_pass_at_each_k_asked_for():
    groups = [[Sample(index=i, group_index=g, reward=float(i < g),
                      tokens=[1, 2, 3], response_length=2)
               for i in range(4)] for g in range(3)]  # fmt: skip
    metrics = eval_metrics(groups, "d", (1, 2, 4))
    assert {"eval/d/pass@1", "eval/d/pass@2", "eval/d/pass@4"} <= set(metrics)
    assert "eval/d/pass@3" not in metrics
    assert metrics["eval/d/pass@1"] == pytest.approx((0 + 1 / 4 + 2 / 4) / 3)
    assert metrics["eval/d/pass@4"] == pytest.approx(2 / 3)
    assert set(eval_metrics(groups, "d")) >= {"eval/d/pass@1", "eval/d/pass@4"}  # as before


# -- the rollout manager evaluates each dataset its own way --------------------------------------


def _as_list(value: dict | list[dict]) -> list[dict]:
    return value if isinstance(value, list) else [value]


class _RecordingPool:
    """An engine pool that answers every prompt with `answer` and records each request."""

    fault_tolerant, router_url = False, None

    def __init__(self, tokenizer, answer: str) -> None:
        self.tokenizer, self.answer, self.requests = tokenizer, answer, []

    async def generate(self, payload: dict) -> dict | list[dict]:
        self.requests.append(payload)
        if isinstance(payload["input_ids"][0], list):  # a batched request: one answer each
            return [self._answer() for _ in payload["input_ids"]]
        return self._answer()

    def _answer(self) -> dict:
        ids = [*self.tokenizer.encode(self.answer, add_special_tokens=False),
               self.tokenizer.eos_token_id]  # fmt: skip
        meta = {"finish_reason": {"type": "stop"},
                "output_token_logprobs": [[-0.1, i, None] for i in ids]}  # fmt: skip
        return {"text": self.answer, "output_ids": ids, "meta_info": meta}

    async def abort_all(self) -> None:
        pass


def test_the_rollout_manager_evaluates_each_dataset_with_its_sampling_and_reward(
    tiny_checkpoint, tmp_path, data, monkeypatch
):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # eval_reward_fns
    path = write(tmp_path, {"datasets": [
        {"name": "exact", "path": "qa.jsonl", "n_samples_per_eval_prompt": 3,
         "temperature": 0.0, "max_response_len": 9, "pass_at_k": [1, 3]},
        {"name": "overlap", "path": "qa.jsonl", "rm_type": "f1", "label_key": "short",
         "n_samples_per_eval_prompt": 2, "eval_interval": 1},
        {"name": "custom", "path": "qa.jsonl", "custom_rm_path": "eval_reward_fns:marked"},
    ]})  # fmt: skip
    rows = [{"input": "What is 2 + 3?", "label": "It is 5.", "short": "5"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = load_config([
        "--hf-checkpoint", str(tiny_checkpoint), "--prompt-data", str(data),
        "--rollout-batch-size", "1", "--rm-type", "exact_match", "--rollout-max-response-len", "20",
        "--output-dir", str(tmp_path / "run"), "--eval-config", str(path),
    ])  # fmt: skip
    manager = RolloutManager(config, None, dp_size=1)
    pool = _RecordingPool(AutoTokenizer.from_pretrained(tiny_checkpoint), "It is 5.")

    async def evaluate() -> tuple[dict[str, float], dict[str, float]]:
        await manager.load_data()
        manager.engines.pool = pool
        return await manager.eval(0), await manager.eval(1, ["overlap"])

    metrics, only = asyncio.run(evaluate())
    assert metrics["eval/exact/samples"] == 3 and metrics["eval/exact/reward_mean"] == 1.0
    assert metrics["eval/exact/pass@3"] == 1.0 and "eval/exact/pass@1" in metrics
    assert metrics["eval/overlap/samples"] == 2
    assert metrics["eval/overlap/reward_mean"] == pytest.approx(0.5)  # F1 of "5" in "It is 5."
    assert metrics["eval/custom/reward_mean"] == -1.0  # eval_reward_fns.MARK, nothing else
    # A batched request carries one sampling setting per prompt.
    sampling = [s for r in pool.requests for s in _as_list(r["sampling_params"])]
    assert {(s["temperature"], s["max_new_tokens"]) for s in sampling} == {(0.0, 9), (1.0, 20)}
    assert manager.eval_reward_hubs["exact"] is manager.reward_hub  # the run's settings: shared
    assert {k.split("/")[1] for k in only} == {"overlap"}  # only the datasets asked for


def test_the_recipe_swaps_the_demos_eval_prompt_data_for_its_eval_config(monkeypatch):
    """`--eval-prompt-data none` clears the list grpo.yaml sets, as docs/guides/recipes.md says."""
    monkeypatch.chdir(REPO)
    config = load_config([
        "--config", "examples/cpu_demo/grpo.yaml", "--hf-checkpoint", "ckpt",
        "--eval-prompt-data", "none", "--eval-config", "examples/cpu_demo/eval_config.yaml",
    ])  # fmt: skip
    assert config.eval.eval_prompt_data is None
    assert [d.name for d in config.eval.eval_datasets] == ["heldout", "heldout_greedy", "train_f1"]
