"""SGLang itself serves a tiny VLM the way the reference engine does: the same /generate body
(`input_ids` the processor expanded, `image_data` as a data: URL) through miles' engine client,
log-probs equal to a float64 Hugging Face forward within float32 GPU kernels' error."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoProcessor

from miles.backends.sglang_utils.server_process import free_port
from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint

from .vision_support import data_url, float64_model, reference_logprobs, shapes_image, user_turn


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and sglang")
@pytest.mark.parametrize("architecture", ["qwen2_5_vl", "qwen3_vl"])
def test_sglang_reads_the_same_image_data_as_the_reference_engine(tmp_path, architecture):
    from miles.backends.sglang_utils.sglang_engine import SGLangEngine, SGLangEngineConfig

    path = build_tiny_checkpoint(tmp_path, architecture=architecture, seed=0)
    processor = AutoProcessor.from_pretrained(path)
    image = shapes_image("red")
    text = processor.apply_chat_template(
        user_turn("how many circles?", 1), add_generation_prompt=True, tokenize=False
    )
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    payload = {"input_ids": inputs["input_ids"][0].tolist(), "image_data": [data_url(image)],
               "return_logprob": True,
               "sampling_params": {"max_new_tokens": 5, "temperature": 1.0, "ignore_eos": True}}  # fmt: skip
    config = SGLangEngineConfig(model_path=str(path), port=free_port(), dtype="float32",
                                mem_fraction_static=0.2, random_seed=0,
                                extra_args={"disable-cuda-graph": True})  # fmt: skip
    with SGLangEngine(config) as engine:
        answer = engine.client.generate(payload)
    served = torch.tensor([e[0] for e in answer["meta_info"]["output_token_logprobs"]]).double()
    _, expected = reference_logprobs(float64_model(path), inputs, answer["output_ids"])
    torch.testing.assert_close(served, expected, atol=2e-2, rtol=0)
