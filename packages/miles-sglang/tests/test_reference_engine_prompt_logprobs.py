"""Prompt (input) log-probs on /generate, as SGLang 0.5.23 returns them: `logprob_start_len`,
`top_logprobs_num`, `token_ids_logprob`, `max_new_tokens: 0` scoring, checked against a float64
forward of the same model over the whole sequence."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT = [10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110]
OTHER = [7, 8, 9, 200, 201]
ASKED = [3, 50, 7]


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """`reference(ids, temperature)`: float64 log-probs (T, V) of every position's next token."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float64).eval()

    def log_probs(ids: list[int], temperature: float = 1.0) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0] / temperature, -1)

    return log_probs


def _generate(url, **body):
    response = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _close(got: list, want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, atol=1e-4, rtol=0)


def _check_top(entries, want: torch.Tensor, k: int) -> None:
    """`entries`: [[logprob, id, text], ...] likeliest first; `want`: one position's (V,)."""
    values, ids = want.topk(k)
    assert [entry[1] for entry in entries] == ids.tolist()
    _close([entry[0] for entry in entries], values)


def test_scoring_the_prompt_matches_a_float64_forward_and_ignores_temperature(
    engine_url, reference
):
    meta = _generate(
        engine_url,
        input_ids=PROMPT,
        return_logprob=True,
        logprob_start_len=0,
        sampling_params={"max_new_tokens": 0, "temperature": 0.5},
    )["meta_info"]
    entries = meta["input_token_logprobs"]
    # One entry per prompt token; the first token has no log-prob.
    assert [entry[1] for entry in entries] == PROMPT
    assert entries[0] == [None, PROMPT[0], None] and all(entry[2] is None for entry in entries)
    want = reference(PROMPT)[:-1].gather(-1, torch.tensor(PROMPT[1:])[:, None]).squeeze(-1)
    _close([entry[0] for entry in entries[1:]], want)
    assert meta["output_token_logprobs"] == [] and meta["output_token_logprobs_length"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["completion_tokens"] == 0 and "input_top_logprobs" not in meta


def test_logprob_start_len_with_top_and_asked_tokens_on_prompt_and_output(
    engine_url, reference, tiny_checkpoint
):
    start, k, temperature = 4, 3, 0.7
    result = _generate(
        engine_url,
        input_ids=PROMPT,
        return_logprob=True,
        logprob_start_len=start,
        top_logprobs_num=k,
        token_ids_logprob=ASKED,
        return_text_in_logprobs=True,
        sampling_params={
            "max_new_tokens": 5,
            "temperature": temperature,
            "seed": 1,
            "ignore_eos": True,
        },
    )
    meta, output = result["meta_info"], result["output_ids"]
    unscaled = reference(PROMPT + output)  # the prompt's log-probs ignore the temperature
    scaled = reference(PROMPT + output, temperature)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)

    tokens, tops, asked = (
        meta["input_token_logprobs"],
        meta["input_top_logprobs"],
        meta["input_token_ids_logprobs"],
    )
    assert len(tokens) == len(tops) == len(asked) == len(PROMPT) - start
    assert [entry[1] for entry in tokens] == PROMPT[start:]
    assert [entry[2] for entry in tokens] == [tokenizer.decode([t]) for t in PROMPT[start:]]
    # SGLang lists no log-prob for the token at logprob_start_len itself, even past 0.
    assert tokens[0][0] is None and tops[0] is None and asked[0] is None
    # Entry j > 0 is drawn from the distribution at prompt position start + j - 1.
    positions = torch.arange(start, len(PROMPT) - 1)
    _close([entry[0] for entry in tokens[1:]], unscaled[positions, PROMPT[start + 1 :]])
    for step, position in zip(tops[1:], positions, strict=True):
        _check_top(step, unscaled[position], k)
    assert all([entry[1] for entry in step] == ASKED for step in asked[1:])
    _close([[entry[0] for entry in step] for step in asked[1:]], unscaled[positions][:, ASKED])

    # The output side is scored at the request's temperature, as the sampled tokens are.
    steps = torch.arange(len(PROMPT) - 1, len(PROMPT) - 1 + len(output))
    _close([entry[0] for entry in meta["output_token_logprobs"]], scaled[steps, output])
    assert len(meta["output_top_logprobs"]) == len(meta["output_token_ids_logprobs"]) == 5
    for step, position in zip(meta["output_top_logprobs"], steps, strict=True):
        _check_top(step, scaled[position], k)
    by_id = [[entry[0] for entry in step] for step in meta["output_token_ids_logprobs"]]
    _close(by_id, scaled[steps][:, ASKED])


def test_default_start_lists_no_prompt_position_and_scoring_only_lists_the_next_token(
    engine_url, reference
):
    generating = _generate(
        engine_url,
        input_ids=OTHER,
        return_logprob=True,
        top_logprobs_num=2,
        sampling_params={"max_new_tokens": 2, "temperature": 0},
    )["meta_info"]
    assert generating["input_token_logprobs"] == [] and generating["input_top_logprobs"] == []
    assert len(generating["output_top_logprobs"]) == 2
    scoring = _generate(
        engine_url,
        input_ids=OTHER,
        return_logprob=True,
        top_logprobs_num=2,
        token_ids_logprob=ASKED,
        sampling_params={"max_new_tokens": 0, "temperature": 0.5},
    )["meta_info"]
    assert scoring["input_token_logprobs"] == [] and scoring["input_top_logprobs"] == []
    assert scoring["input_token_ids_logprobs"] == [] and scoring["output_token_logprobs"] == []
    # SGLang still lists one output entry: the unscaled distribution after the prompt.
    after = reference(OTHER)[-1]
    (top,) = scoring["output_top_logprobs"]
    _check_top(top, after, 2)
    (asked,) = scoring["output_token_ids_logprobs"]
    _close([entry[0] for entry in asked], after[ASKED])


def test_batch_with_per_item_values_scores_and_generates_side_by_side(engine_url, reference):
    items = _generate(
        engine_url,
        input_ids=[PROMPT, OTHER, OTHER],
        return_logprob=[True, True, False],
        logprob_start_len=[0, 2, 99],  # ignored without return_logprob, as in SGLang
        top_logprobs_num=[0, 2, 0],
        token_ids_logprob=[[5], [6, 7], []],
        sampling_params=[
            {"max_new_tokens": 0},
            {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
            {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
        ],
    )
    first, second, third = (item["meta_info"] for item in items)
    assert len(first["input_token_logprobs"]) == len(PROMPT) and items[0]["output_ids"] == []
    assert first["input_token_ids_logprobs"][0] is None and "input_top_logprobs" not in first
    full = reference(PROMPT)
    _close([step[0][0] for step in first["input_token_ids_logprobs"][1:]], full[:-1, 5])
    assert [entry[1] for entry in second["input_token_logprobs"]] == OTHER[2:]
    assert len(second["input_top_logprobs"]) == len(OTHER) - 2
    assert [[e[1] for e in step] for step in second["output_token_ids_logprobs"]] == [[6, 7]] * 4
    # Scoring the first item alongside does not change the others' greedy continuation.
    assert items[1]["output_ids"] == items[2]["output_ids"] and len(items[2]["output_ids"]) == 4
    assert "input_token_logprobs" not in third
    output = items[1]["output_ids"]
    full = reference(OTHER + output)
    listed = torch.arange(2, len(OTHER) - 1)
    _close([entry[0] for entry in second["input_token_logprobs"][1:]], full[listed, OTHER[3:]])
    steps = torch.arange(len(OTHER) - 1, len(OTHER) - 1 + len(output))
    assert full[steps].argmax(-1).tolist() == output
    _close([entry[0] for entry in second["output_token_logprobs"]], full[steps, output])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"logprob_start_len": 6}, "logprob_start_len=6 is out of range for a prompt of 5 tokens"),
        ({"logprob_start_len": -2}, "it must be -1 (no prompt log-probs) or in [0, 5]"),
        ({"token_ids_logprob": [1, 10**6]}, "token_ids_logprob contains token id 1000000"),
        ({"token_ids_logprob": [[1], [2]]}, "must be a flat list of token ids for a single prompt"),
        ({"token_ids_logprob": 3}, "token_ids_logprob"),
        ({"logprob_start_len": "0"}, "logprob_start_len"),
    ],
)
def test_bad_logprob_fields_are_refused_naming_the_field(engine_url, fields, message):
    body = {"input_ids": OTHER, "return_logprob": True, "sampling_params": {"max_new_tokens": 0}}
    response = httpx.post(f"{engine_url}/generate", json={**body, **fields}, timeout=60)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def test_per_item_lists_must_match_the_batch(engine_url):
    body = {
        "input_ids": [OTHER, PROMPT],
        "return_logprob": True,
        "logprob_start_len": [0, 0, 0],
        "sampling_params": {"max_new_tokens": 0},
    }
    response = httpx.post(f"{engine_url}/generate", json=body, timeout=60)
    assert response.status_code == 400
    assert "logprob_start_len has 3 entries for 2 prompts" in response.json()["error"]["message"]
    body = {**body, "logprob_start_len": [0, len(PROMPT) + 1]}
    message = httpx.post(f"{engine_url}/generate", json=body, timeout=60).json()["error"]
    assert message["param"] == "logprob_start_len[1]"
    assert f"in [0, {len(PROMPT)}]" in message["message"]
