"""Prompt rows with images (--multimodal-keys) read from real JSONL and Parquet files, tokenized by
a tiny Qwen2.5-VL's own processor."""

from __future__ import annotations

import base64
import io
import json

import datasets
import pytest
from PIL import Image, ImageDraw
from transformers import AutoProcessor, AutoTokenizer

from miles.backends.sglang_utils.image_data import decode_image, image_bytes
from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint
from miles.backends.sglang_utils.tiny_vlm import IMAGE_PAD_ID, VISION_START_ID
from miles.backends.training_utils.batching.rollout_data import samples_to_rollout_batch
from miles.config.cross_checks import check_images
from miles.rollout.data_source import DataSourceConfig, PromptDataset, RolloutDataSource


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("vlm"), architecture="qwen2_5_vl")


@pytest.fixture(scope="module")
def processor(vlm):
    return AutoProcessor.from_pretrained(vlm)


@pytest.fixture(scope="module")
def tokenizer(vlm):
    return AutoTokenizer.from_pretrained(vlm)


def png(colour: str, size=(84, 56)) -> bytes:
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).rectangle((5, 5, 30, 30), fill=colour)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def load(path, tokenizer, processor, **overrides):
    settings = {"multimodal_keys": {"image": "images"}, "apply_chat_template": True, **overrides}
    return PromptDataset(DataSourceConfig(prompt_data=str(path), **settings), tokenizer,
                         processor=processor)  # fmt: skip


def test_images_as_paths_data_urls_and_base64_reach_the_record_and_the_sample(
    tmp_path, tokenizer, processor
):
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "red.png").write_bytes(png("red"))
    blue = png("blue")
    rows = [
        {"input": "how many?", "label": "1", "images": "pics/red.png"},
        {"input": "colour?", "label": "b", "images": [
            "data:image/png;base64," + base64.b64encode(blue).decode(),
            base64.b64encode(png("green", (112, 112))).decode(),
        ]},
        {"input": "no picture", "label": "x", "images": None},
    ]  # fmt: skip
    dataset = load(write_jsonl(tmp_path / "data.jsonl", rows), tokenizer, processor)
    red, two, text = dataset[0], dataset[1], dataset[2]

    assert image_bytes(red.images[0]) == png("red")  # the file's own bytes, not re-encoded
    assert image_bytes(two.images[0]) == blue and len(two.images) == 2
    assert text.images == () and IMAGE_PAD_ID not in text.prompt_ids
    # The chat template put each image before the text; the processor expanded its tokens.
    assert red.messages[0]["content"] == [{"type": "image"}, {"type": "text", "text": "how many?"}]
    expected = processor(text=[two.prompt], images=[decode_image(i) for i in two.images])
    assert two.prompt_ids == list(expected["input_ids"][0])
    grids = expected["image_grid_thw"]
    assert two.prompt_ids.count(IMAGE_PAD_ID) == int(grids.prod(-1).sum()) // 4
    assert two.prompt_ids.count(VISION_START_ID) == 2

    source = RolloutDataSource(dataset, dataset.config, n_samples_per_prompt=2)
    samples = [s for g in source.get_samples(3) for s in g]
    records = {r.prompt: r for r in (red, two, text)}
    assert [s.images or [] for s in samples] == [list(records[s.prompt].images) for s in samples]
    assert sorted(len(s.images or ()) for s in samples) == [0, 0, 1, 1, 2, 2]
    for s in samples:
        s.reward = 0.0
    batch = samples_to_rollout_batch(samples, [0.0] * len(samples))
    assert [len(i) for i in batch["images"]] == [len(s.images or ()) for s in samples]


def test_parquet_image_structs_are_read(tmp_path, tokenizer, processor):
    features = datasets.Features({
        "input": datasets.Value("string"), "label": datasets.Value("string"),
        "images": datasets.Sequence(datasets.Image()),
    })  # fmt: skip
    rows = {"input": ["a", "b"], "label": ["1", "2"],
            "images": [[{"bytes": png("red"), "path": None}], []]}  # fmt: skip
    path = tmp_path / "data.parquet"
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(path))
    dataset = load(path, tokenizer, processor)
    # datasets hands the Image feature over decoded: the pixels arrive unchanged.
    assert (
        decode_image(dataset[0].images[0]).tobytes()
        == decode_image(base64.b64encode(png("red")).decode()).tobytes()
    )
    assert dataset[1].images == ()


def test_every_bad_image_is_named_with_its_line_at_load(tmp_path, tokenizer, processor):
    rows = [
        {"input": "fine", "label": "1", "images": None},
        {"input": "missing", "label": "1", "images": "pics/nowhere.png"},
        {"input": "corrupt", "label": "1", "images": "data:image/png;base64,"
         + base64.b64encode(png("red")[:60]).decode()},
        {"input": "junk", "label": "1", "images": ["not an image at all!"]},
        {"input": [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                {"type": "text", "text": "two?"}]}],
         "label": "1", "images": [base64.b64encode(png("red")).decode()]},
    ]  # fmt: skip
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError) as caught:
        load(path, tokenizer, processor)
    message = str(caught.value)
    assert "4 rows cannot be used" in message
    assert f"{path}:2, image 1 of 1: no image file 'pics/nowhere.png'" in message
    assert f"{path}:3, image 1 of 1: 60 bytes that do not decode as an image" in message
    assert f"{path}:4, image 1 of 1: 'not an image at all!' is neither an image file" in message
    assert f"{path}:5: the messages place 2 image(s) but the row has 1" in message


def test_image_settings_are_refused_before_start_up(tmp_path, vlm):
    data = write_jsonl(tmp_path / "d.jsonl", [{"input": "x", "label": "1"}])
    with pytest.raises(ValueError, match="supported media: image"):
        DataSourceConfig(prompt_data=data, multimodal_keys={"video": "clips"},
                         apply_chat_template=True)  # fmt: skip
    with pytest.raises(ValueError, match="pass --apply-chat-template"):
        DataSourceConfig(prompt_data=data, multimodal_keys={"image": "images"})
    text_model = build_tiny_checkpoint(tmp_path / "text")
    config = DataSourceConfig(prompt_data=data, multimodal_keys={"image": "images"},
                              apply_chat_template=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"\(qwen3\) has no vision tower"):
        check_images(config, str(text_model))
    check_images(config, str(vlm))  # a VLM takes it
