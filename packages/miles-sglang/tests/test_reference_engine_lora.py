"""LoRA serving in the reference engine, with SGLang's API: adapters made with PEFT are served as
PEFT computes them, on the fast path and on the Hugging Face forward, each request with its own
adapter inside a mixed batch; reloads take effect; refusals say why. The engines are served from
this process (`in_process_engine`) over HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from miles.backends.sglang_utils.reference_engine import (
    ReferenceEngine,
    ReferenceEngineConfig,
)
from miles.backends.sglang_utils.weight_sync import serialize_named_tensors

from .in_process_engine import serve_in_process
from .lora_support import (
    assert_engine_matches_model,
    engine_greedy,
    engine_token_logprobs,
    make_peft_model,
    model_token_logprobs,
    save_adapter,
)

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]  # "Hello, w"
OTHER_PROMPT = [84, 104, 101, 32, 99, 97, 116]  # "The cat"


@dataclass
class Adapters:
    first: torch.nn.Module
    """rank 4, alpha 8: q_proj, v_proj, down_proj."""
    first_dir: Path
    second: torch.nn.Module
    """rank 8, alpha 16, rsLoRA: every projection the shared engine adapts."""
    second_dir: Path
    root: Path


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory) -> Adapters:
    root = tmp_path_factory.mktemp("lora")
    first = make_peft_model(tiny_checkpoint, rank=4, alpha=8, seed=1)
    second = make_peft_model(
        tiny_checkpoint, rank=8, alpha=16, seed=2, use_rslora=True,
        targets=("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"),
    )  # fmt: skip
    return Adapters(first, save_adapter(first, root / "first"), second,
                    save_adapter(second, root / "second"), root)  # fmt: skip


@pytest.fixture(scope="module")
def served(lora_engine) -> httpx.Client:
    """A client, with the admin key, of the shared LoRA engine (the fast path)."""
    engine, client = lora_engine
    assert engine.scheduler.runner.decoder is not None
    return client


@pytest.fixture(scope="module")
def hf_engine(tiny_checkpoint, adapters) -> Iterator[tuple[ReferenceEngine, httpx.Client]]:
    """An in-process engine on the Hugging Face forward, 2 adapters per batch, with `first`
    loaded at start-up (--lora-paths)."""
    config = ReferenceEngineConfig(
        model_path=str(tiny_checkpoint), device="cpu", disable_fast_decode=True,
        admission_quiet_ms=0, enable_lora=True, max_lora_rank=8, lora_target_modules=["all"],
        max_loras_per_batch=2, lora_paths=[f"first={adapters.first_dir}"],
    )  # fmt: skip
    with serve_in_process(config) as served_here:
        yield served_here


def _load(engine: httpx.Client, name: str, path: Path, **fields) -> httpx.Response:
    return engine.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(path),
                                                   **fields})  # fmt: skip


def _loaded(engine: httpx.Client, name: str, path: Path) -> None:
    answer = _load(engine, name, path)
    assert answer.status_code == 200, answer.text
    assert answer.json()["success"] and answer.json()["loaded_adapters"][name] == str(path)


# -- served as PEFT computes it -------------------------------------------------------------------


def test_the_fast_path_scores_and_generates_as_peft_with_each_adapter_and_as_the_base_without(
    served, adapters
):
    _loaded(served, "fast-first", adapters.first_dir)
    _loaded(served, "fast-second", adapters.second_dir)
    assert_engine_matches_model(served, adapters.first, PROMPT, lora_path="fast-first")
    assert_engine_matches_model(served, adapters.second, OTHER_PROMPT, lora_path="fast-second")
    with adapters.first.disable_adapter():
        assert_engine_matches_model(served, adapters.first, PROMPT, lora_path=None)


def test_the_hf_forward_scores_and_generates_as_peft_with_an_adapter_loaded_at_start(
    hf_engine, adapters
):
    engine, client = hf_engine
    assert engine.scheduler.runner.decoder is None  # the Hugging Face forward, hooked
    assert_engine_matches_model(client, adapters.first, PROMPT, lora_path="first")
    _loaded(client, "hf-second", adapters.second_dir)
    assert_engine_matches_model(client, adapters.second, OTHER_PROMPT, lora_path="hf-second")
    with adapters.first.disable_adapter():
        assert_engine_matches_model(client, adapters.first, PROMPT, lora_path=None)


def test_a_mixed_batch_gives_each_row_what_it_gets_alone(served, adapters):
    _loaded(served, "mixed-first", adapters.first_dir)
    _loaded(served, "mixed-second", adapters.second_dir)
    rows = [(PROMPT, "mixed-first"), (PROMPT, None), (OTHER_PROMPT, "mixed-second"),
            (PROMPT, "mixed-first")]  # fmt: skip
    body = {"input_ids": [prompt for prompt, _ in rows], "lora_path": [name for _, name in rows],
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}}  # fmt: skip
    batch = served.post("/generate", json=body).json()
    alone = [engine_greedy(served, prompt, lora_path=name, tokens=8)[0] for prompt, name in rows]
    assert [answer["output_ids"] for answer in batch] == alone
    assert alone[0] != alone[1]  # the adapter changes what the model writes
    # The prompt is shared between the rows of one adapter only: KV through an adapter differs.
    cached = [answer["meta_info"]["cached_tokens"] for answer in batch]
    assert cached == [0, 0, 0, len(PROMPT)]


def test_a_batch_of_more_adapters_than_max_loras_per_batch_runs_them_in_turns(hf_engine, adapters):
    engine, client = hf_engine  # --max-loras-per-batch 2: the base model takes a slot too
    _loaded(client, "turns-second", adapters.second_dir)
    runner = engine.scheduler.runner
    decode, seen = runner.decode, []

    def counting_decode(state, tokens):
        seen.append(len({id(a) for a in (state.adapters or [None] * state.size)}))
        return decode(state, tokens)

    runner.decode = counting_decode  # type: ignore[method-assign]
    try:
        rows = [(PROMPT, "first"), (PROMPT, "turns-second"), (OTHER_PROMPT, None)]
        body = {"input_ids": [p for p, _ in rows], "lora_path": [n for _, n in rows],
                "sampling_params": {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}}  # fmt: skip
        batch = client.post("/generate", json=body).json()
    finally:
        runner.decode = decode  # type: ignore[method-assign]
    assert max(seen) <= 2
    alone = [engine_greedy(client, prompt, lora_path=name, tokens=5)[0] for prompt, name in rows]
    assert [answer["output_ids"] for answer in batch] == alone


def test_a_name_unloaded_and_loaded_again_serves_the_new_weights(served, adapters):
    _loaded(served, "swap", adapters.first_dir)
    first = engine_token_logprobs(served, PROMPT, lora_path="swap")
    torch.testing.assert_close(
        first, model_token_logprobs(adapters.first, PROMPT), rtol=0, atol=1e-4
    )
    answer = served.post("/unload_lora_adapter", json={"lora_name": "swap"})
    assert answer.status_code == 200 and "swap" not in answer.json()["loaded_adapters"]
    _loaded(served, "swap", adapters.second_dir)
    assert_engine_matches_model(served, adapters.second, PROMPT, lora_path="swap")


def test_openai_routes_take_sglangs_base_colon_adapter_model_name(served, adapters):
    _loaded(served, "openai-first", adapters.first_dir)
    body = {"model": "tiny:openai-first", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    answer = served.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    expected, _ = engine_greedy(served, PROMPT, lora_path="openai-first", tokens=6)
    assert answer.json()["choices"][0]["token_ids"] == expected


def test_base_weight_updates_keep_working_under_loaded_adapters(
    hf_engine, adapters, tiny_checkpoint, other_checkpoint
):
    from peft import PeftModel

    _, client = hf_engine
    other = AutoModelForCausalLM.from_pretrained(other_checkpoint, dtype=torch.float32)
    payload = serialize_named_tensors(list(other.state_dict().items()))
    answer = client.post(
        "/update_weights_from_tensor", json={"serialized_named_tensors": [payload]}
    )
    assert answer.json()["success"], answer.text
    try:
        on_other = PeftModel.from_pretrained(other, str(adapters.first_dir)).eval()
        assert_engine_matches_model(client, on_other, PROMPT, lora_path="first")
    finally:
        back = client.post("/update_weights_from_disk", json={"model_path": str(tiny_checkpoint)})
        assert back.json()["success"], back.text
    assert_engine_matches_model(client, adapters.first, PROMPT, lora_path="first")


# -- refusals -------------------------------------------------------------------------------------


def _variant(source: Path, into: Path, *, config=None, tensors=None) -> Path:
    """A copy of adapter `source` with its config updated by `config` and its tensors passed
    through `tensors(dict) -> dict`."""
    shutil.copytree(source, into)
    if config is not None:
        settings = json.loads((into / "adapter_config.json").read_text())
        (into / "adapter_config.json").write_text(json.dumps({**settings, **config}))
    if tensors is not None:
        file = into / "adapter_model.safetensors"
        save_file(tensors(load_file(str(file))), str(file))
    return into


def _deeper(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The matrices of layer 1 moved to a layer 7 the tiny model does not have."""
    return {name.replace("layers.1.", "layers.7."): t for name, t in tensors.items()}


@pytest.fixture(scope="module")
def refused(adapters, tiny_checkpoint) -> dict[str, tuple[Path, str]]:
    """Adapter directories the engine refuses: {case: (directory, what the refusal says)}."""
    root, first = adapters.root, adapters.first_dir
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    cases = {
        "rank above --max-lora-rank": (
            save_adapter(
                make_peft_model(tiny_checkpoint, rank=16, targets=("q_proj",)), root / "r16"
            ),
            "has rank 16, above --max-lora-rank 8",
        ),
        "target outside --lora-target-modules": (
            save_adapter(make_peft_model(tiny_checkpoint, targets=("gate_proj",)), root / "gate"),
            "adapts ['gate_proj'], outside --lora-target-modules",
        ),
        "module not in the model": (
            _variant(first, root / "deep", tensors=_deeper),
            "targets modules the served model does not have",
        ),
        "shape not the model's": (
            _variant(first, root / "wide", tensors=lambda t: {**t, q_a: torch.zeros(4, 48)}),
            "has lora_A (4, 48) and lora_B (64, 4), but the model's layer maps 64 to 64 features",
        ),
        "DoRA": (_variant(first, root / "dora", config={"use_dora": True}), "DoRA (use_dora)"),
        "modules_to_save": (
            _variant(first, root / "saved", config={"modules_to_save": ["lm_head"]}),
            "modules_to_save replaces whole modules",
        ),
        "bias": (_variant(first, root / "bias", config={"bias": "all"}), "bias='all' trains"),
        "no weights file": (
            _variant(first, root / "bare", tensors=None),
            "has no adapter_model.safetensors",
        ),
        "malformed config": (_variant(first, root / "garbled"), "cannot read"),
        "missing directory": (root / "nowhere", "is not a directory"),
    }
    (root / "bare" / "adapter_model.safetensors").unlink()
    (root / "garbled" / "adapter_config.json").write_text("{not json")
    return cases


REFUSED_CASES = ["rank above --max-lora-rank", "target outside --lora-target-modules",
                 "module not in the model", "shape not the model's", "DoRA", "modules_to_save",
                 "bias", "no weights file", "malformed config", "missing directory"]  # fmt: skip


@pytest.mark.parametrize("case", REFUSED_CASES)
def test_an_adapter_the_engine_cannot_serve_is_refused_with_the_reason(served, refused, case):
    path, reason = refused[case]
    answer = _load(served, f"refused-{case}", path)
    assert answer.status_code == 400
    body = answer.json()
    assert body["success"] is False and reason in body["error_message"], body["error_message"]
    assert f"refused-{case}" not in body["loaded_adapters"]


def test_loading_a_name_twice_unloading_a_stranger_and_generating_with_one_are_refused(
    served, adapters
):
    _loaded(served, "twice", adapters.first_dir)
    again = _load(served, "twice", adapters.second_dir)
    assert again.status_code == 400
    assert "a LoRA adapter named 'twice' is already loaded" in again.json()["error_message"]
    gone = served.post("/unload_lora_adapter", json={"lora_name": "stranger"})
    assert gone.status_code == 400
    assert "no LoRA adapter named 'stranger' is loaded" in gone.json()["error_message"]
    unknown = served.post("/generate", json={"input_ids": PROMPT, "lora_path": "stranger"})
    assert unknown.status_code == 400
    message = unknown.json()["error"]["message"]
    assert "lora_path 'stranger' names no loaded LoRA adapter (loaded: [" in message
    assert "'twice'" in message  # the loaded ones are named
    mismatched = served.post("/generate", json={"input_ids": [PROMPT, PROMPT],
                                                "lora_path": ["twice"]})  # fmt: skip
    assert mismatched.status_code == 400
    assert "lora_path has 1 entries for 2 prompts" in mismatched.json()["error"]["message"]


def test_the_lora_routes_take_the_admin_key(served, adapters):
    body = {"lora_name": "keyless", "lora_path": str(adapters.first_dir)}
    answer = httpx.post(f"{served.base_url}/load_lora_adapter", json=body, timeout=30)
    assert answer.status_code == 401


def test_more_pinned_adapters_than_max_loras_per_batch_minus_one_are_refused(hf_engine, adapters):
    _, client = hf_engine  # --max-loras-per-batch 2: one adapter may be pinned
    assert _load(client, "pinned-1", adapters.first_dir, pinned=True).status_code == 200
    answer = _load(client, "pinned-2", adapters.second_dir, pinned=True)
    assert answer.status_code == 400
    assert "cannot pin LoRA adapter 'pinned-2'" in answer.json()["error_message"]


def test_an_engine_without_enable_lora_refuses_loads_and_lora_paths(tiny_checkpoint, adapters):
    config = ReferenceEngineConfig(model_path=str(tiny_checkpoint), device="cpu")
    with serve_in_process(config) as (_, client):
        load = _load(client, "first", adapters.first_dir)
        generate = client.post("/generate", json={"input_ids": PROMPT, "lora_path": "first"})
    assert load.status_code == 400 and "LoRA is not enabled" in load.json()["error_message"]
    assert generate.status_code == 400
    assert "but LoRA is not enabled: start the engine with --enable-lora" in generate.text


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"max_lora_rank": 8}, "--max-lora-rank (8) has no effect without --enable-lora"),
        ({"enable_lora": True, "max_lora_rank": 8},
         "--enable-lora without --lora-paths needs --lora-target-modules"),
        ({"enable_lora": True, "max_lora_rank": 0, "lora_target_modules": ["all"]},
         "--max-lora-rank must be >= 1, got 0"),
        ({"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["lm_head"]},
         "--lora-target-modules ['lm_head'] are not projections the reference engine adapts"),
        ({"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["all", "q_proj"]},
         "--lora-target-modules all must stand alone"),
        ({"max_loras_per_batch": 0}, "--max-loras-per-batch must be >= 1, got 0"),
        ({"lora_paths": ["a=/x", "a=/y"]}, "--lora-paths names adapter 'a' twice"),
        ({"lora_paths": ["=/x"]}, "--lora-paths entry '=/x' must be NAME=PATH or PATH"),
    ],
)  # fmt: skip
def test_lora_flags_are_checked_at_start_up(flags, message):
    with pytest.raises(ValueError) as refusal:
        ReferenceEngineConfig(model_path="unused", **flags)
    assert message in str(refusal.value)


def test_an_adapter_of_lora_paths_that_cannot_be_served_stops_the_start(tiny_checkpoint, refused):
    path, reason = refused["DoRA"]
    config = ReferenceEngineConfig(model_path=str(tiny_checkpoint), device="cpu",
                                   lora_paths=[f"dora={path}"])  # fmt: skip
    with pytest.raises(ValueError) as refusal:
        ReferenceEngine(config)
    assert f"--lora-paths dora={path}: " in str(refusal.value) and reason in str(refusal.value)


def test_lora_paths_alone_turn_lora_on_and_set_the_limits_to_their_adapters(
    tiny_checkpoint, adapters
):
    # As SGLang: the largest rank and every projection the start-up adapters adapt; a bare PATH
    # is its own name.
    path = str(adapters.first_dir)
    config = ReferenceEngineConfig(model_path=str(tiny_checkpoint), device="cpu", lora_paths=[path])
    engine = ReferenceEngine(config)
    try:
        assert config.enable_lora and engine.loras is not None
        assert engine.loras.max_rank == 4
        assert engine.loras.target_modules == {"q_proj", "v_proj", "down_proj"}
        assert engine.loras.loaded_paths() == {path: path}
    finally:
        engine.scheduler.shutdown()


def test_an_all_linear_adapter_names_its_projections_as_sglang_does(tiny_checkpoint, tmp_path):
    """PEFT writes the module paths it resolved all-linear to; the engine, like SGLang, keeps
    each one's last part, so `--lora-target-modules all` (or the projection names) covers it."""
    from peft import LoraConfig, get_peft_model

    from miles.backends.sglang_utils.reference_engine.peft_adapter import read_peft_lora

    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    get_peft_model(base, LoraConfig(r=4, target_modules="all-linear")).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())["target_modules"]
    assert "model.layers.0.self_attn.q_proj" in saved
    lora = read_peft_lora(str(tmp_path))
    assert lora.target_modules == (
        "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj",
    )  # fmt: skip
