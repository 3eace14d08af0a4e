"""The prompts a run trains on: read from a local JSONL/JSON/Parquet file, rendered and tokenized once.

`PromptDataset` is a plain indexable list of `PromptRecord`s; in what order they are served (epochs,
shuffling, resume) is `RolloutDataSource`'s business, in `miles.rollout.data_source`. Remote datasets
(hub names, URLs) are deliberately not read here: nothing is downloaded at run time
(architecture.md: "Defaults that run with no infrastructure").
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.rollout.chat_template import ChatTemplate, check_template_settings
from miles.rollout.mixture import MIXTURE_SUFFIXES, is_mixture_file, read_mixture
from miles.rollout.prompt_images import (
    IMAGE_PART_TYPES,
    check_multimodal_keys,
    place_images,
    processor_prompt_ids,
    row_images,
)
from miles.rollout.rewards.sample_reward import SampleReward, check_row_reward

if TYPE_CHECKING:
    import datasets

    from miles.rollout.mixture import MixtureSource
    from miles.rollout.rewards.config import RewardConfig

logger = logging.getLogger(__name__)

# File suffix -> the `datasets` builder that reads it.
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_DEFAULT_METADATA_KEY = "metadata"


@dataclass(kw_only=True)
class DataSourceConfig:
    """Where the prompts come from, how they are rendered, and in what order they are served."""

    prompt_data: str
    """Path of a local .jsonl, .json or .parquet file with one prompt per row (--prompt-data), or
    of a .yaml mixture of several, each with a weight, its own keys and reward
    (`miles.rollout.mixture`)."""
    input_key: str = "input"
    """Column holding the prompt: a string, or a list of chat messages `{"role", "content"}`."""
    label_key: str | None = "label"
    """Column holding the ground truth for the reward function; None for a task without labels."""
    metadata_key: str | None = _DEFAULT_METADATA_KEY
    """Column of dicts copied into `Sample.metadata`. The default may be absent from the file
    (metadata is then `{}`); a column named explicitly must exist. None: never read metadata."""
    apply_chat_template: bool = False
    """Render prompts with the tokenizer's chat template (with the generation prompt); a plain
    string becomes one user message. Without it, prompts must be strings and are used as is."""
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Variables for the chat template, a JSON object (e.g. '{"enable_thinking": false}' for
    Qwen3); needs --apply-chat-template."""
    chat_template_path: str | None = None
    """A Jinja chat template file, used instead of the tokenizer's own; needs
    --apply-chat-template."""
    multimodal_keys: dict[str, str] | None = None
    """Media columns of the data, a JSON object from media type to column (upstream's flag), e.g.
    '{"image": "images"}'. Each row's images (a path relative to the data file, a data: URL or
    base64; one or a list) go to the engine and the trainer; the chat template places their
    tokens (needs --apply-chat-template and a checkpoint with a vision tower)."""
    tool_key: str | None = None
    """Column holding each row's tools: a list of names of --tool-paths functions (for
    miles.rollout.tool_rollout); None: every row may call every tool."""
    rollout_max_prompt_len: int | None = None
    """Drop prompts longer than this many tokens (after rendering); None keeps all (prompts
    that fill the model's whole context are always dropped: nothing could be generated)."""
    strict_data: bool = False
    """Refuse the data at the first row that would be dropped (too long for
    --rollout-max-prompt-len or for the model's context), naming its file and line."""
    rollout_shuffle: bool = True
    """Serve each epoch in a fresh seeded random order; False serves the file order every epoch."""
    rollout_seed: int = 42
    """Epoch `e` is shuffled with seed `rollout_seed + e`, so a resumed run sees the same order."""

    def __post_init__(self) -> None:
        suffix = Path(self.prompt_data).suffix.lower()
        if is_mixture_file(self.prompt_data):
            read_mixture(self.prompt_data, tuple(_BUILDERS))  # checked now, read at load
        elif suffix not in _BUILDERS:
            raise ValueError(
                f"--prompt-data {self.prompt_data!r} must be a local {', '.join(_BUILDERS)} file "
                f"(or a {'/'.join(MIXTURE_SUFFIXES)} mixture of them), got suffix "
                f"{suffix or '(none)'!r}; convert the data to JSONL or Parquet"
            )
        if not self.input_key:
            raise ValueError("--input-key must name the column holding the prompts, got ''")
        if self.rollout_max_prompt_len is not None and self.rollout_max_prompt_len < 1:
            raise ValueError(
                f"--rollout-max-prompt-len ({self.rollout_max_prompt_len}) must be at least 1; "
                "leave it unset to keep every prompt"
            )
        check_template_settings(
            apply_chat_template=self.apply_chat_template,
            kwargs=self.apply_chat_template_kwargs,
            template_path=self.chat_template_path,
        )
        check_multimodal_keys(self.multimodal_keys)
        if self.multimodal_keys and not self.apply_chat_template:
            raise ValueError(
                "--multimodal-keys: images need the chat template to place their tokens; pass "
                "--apply-chat-template"
            )

    @property
    def image_key(self) -> str | None:
        """The column of each row's images (--multimodal-keys), None for text-only data."""
        return (self.multimodal_keys or {}).get("image")

    @property
    def mixture(self) -> list[MixtureSource] | None:
        """The sources of a mixture file, None for one prompt file."""
        if not is_mixture_file(self.prompt_data):
            return None
        return read_mixture(self.prompt_data, tuple(_BUILDERS))

    @property
    def chat_template(self) -> ChatTemplate:
        return ChatTemplate.from_settings(self.apply_chat_template_kwargs, self.chat_template_path)


@dataclass(frozen=True, kw_only=True)
class PromptRecord:
    """One prompt, ready to generate from."""

    prompt: str
    """The text the model sees (chat template applied when configured)."""
    prompt_ids: list[int]
    """Token ids of `prompt`; treat as read-only, samples get their own copy."""
    label: str | None
    """Ground truth for the reward function; non-string labels are JSON-encoded."""
    metadata: dict[str, Any]
    """The row's metadata dict; samples get a deep copy."""
    messages: list[dict[str, Any]] | None = None
    """The chat messages `prompt` was rendered from (None without --apply-chat-template)."""
    tools: list[str] | None = None
    """The names of the tools this row's rollout may call (--tool-key)."""
    images: tuple[str, ...] = ()
    """The row's images as data: URLs, in the order their tokens appear (--multimodal-keys)."""


class PromptDataset:
    """Every prompt of `--prompt-data` that passes the length filters, in file order.

    Rendering and tokenization happen once, here, so the length filters and the data source's
    counts (epochs, resume checks) agree on which prompts exist. Every row is checked here, at
    load, and an error names its file and 1-based line (row, for JSON arrays and Parquet).
    """

    dropped: int
    """How many prompts the length filters removed."""
    dropped_by: dict[str, int]
    """The same, by the limit that removed them (e.g. "the model's context")."""

    def __init__(
        self,
        config: DataSourceConfig,
        tokenizer: Any,
        *,
        labels_required: bool = False,
        context_length: int | None = None,
        reward: RewardConfig | None = None,
        processor: Any = None,
    ) -> None:
        """`labels_required`: the reward reads the label, so a row without one is an error.
        `context_length`: the model's (prompt + response) token limit; a prompt that fills it
        is dropped (an engine refuses it). `reward`: the run's; a row naming its own in its
        metadata (`miles.rollout.rewards.sample_reward`) is checked against it, and needs a
        label exactly when its own reward reads one. `processor`: the checkpoint's (AutoProcessor),
        which turns a row with images into token ids; needed with --multimodal-keys."""
        self.config = config
        path = Path(config.prompt_data)
        table, lines = _read_table(path)
        where = _row_locations(path, len(table), lines)
        columns = list(table.column_names)
        inputs = table[_require_column(config.input_key, "--input-key", config, columns)]
        labels = (
            [None] * len(inputs)
            if config.label_key is None
            else table[_require_column(config.label_key, "--label-key", config, columns)]
        )
        metadata = _metadata_column(table, config, columns)
        tools = (
            [None] * len(inputs)
            if config.tool_key is None
            else table[_require_column(config.tool_key, "--tool-key", config, columns)]
        )
        image_values = (
            [None] * len(inputs)
            if config.image_key is None
            else table[
                _require_column(config.image_key, "--multimodal-keys image", config, columns)
            ]
        )
        if config.image_key is not None and processor is None:
            raise ValueError(
                "--multimodal-keys: the data has images but the checkpoint has no processor to "
                "read them (a model with a vision tower saves one); check --hf-checkpoint"
            )

        # Every bad row is found in one pass: a file is fixed in one go, not a row per run.
        bad = _BadRows(config.prompt_data)
        template = config.chat_template if config.apply_chat_template else None
        chats = [bad.attempt(row, _messages, where[row], v, config) for row, v in enumerate(inputs)]
        data_dir = path.parent
        images = [
            bad.attempt(row, row_images, where[row], value, data_dir) or []
            for row, value in enumerate(image_values)
        ]
        for row, chat in enumerate(chats):
            if chat is not None and row not in bad:
                chats[row] = bad.attempt(row, place_images, where[row], chat, len(images[row]))
        prompts = [
            ""
            if row in bad
            else bad.attempt(row, _render, where[row], v, chat, tokenizer, template)
            for row, (v, chat) in enumerate(zip(inputs, chats, strict=True))
        ]
        prompts = [p or "" for p in prompts]
        # A chat template writes its own special tokens (BOS included, where the model has one);
        # plain text gets the tokenizer's usual ones, as an engine given the text would add.
        ids = tokenizer(prompts, add_special_tokens=not config.apply_chat_template)["input_ids"]
        for row, row_images_ in enumerate(images):
            if row_images_ and row not in bad:
                # The processor expands each image's placeholder to one token per merged patch.
                ids[row] = bad.attempt(row, _image_prompt_ids, where[row], processor, prompts[row],
                                       row_images_) or []  # fmt: skip

        self._records: list[PromptRecord] = []
        self.own_rewards: dict[SampleReward, str] = {}
        """Each reward a row names in its metadata, with the first row naming it."""
        limits = _length_limits(config.rollout_max_prompt_len, context_length)
        self.dropped_by = dict.fromkeys(limits, 0)
        for row, (prompt, prompt_ids) in enumerate(zip(prompts, ids, strict=True)):
            if row in bad:
                continue
            record = bad.attempt(row, self._record, where[row], prompt, prompt_ids, labels[row],
                                 metadata[row], chats[row], tools[row], limits, labels_required,
                                 reward, images[row])  # fmt: skip
            if isinstance(record, str):  # dropped by this length limit
                self.dropped_by[record] += 1
            elif record is not None:
                self._records.append(record)
        bad.raise_if_any()
        self.dropped = len(prompts) - len(self._records)
        self._report_filter(total=len(prompts), lengths=[len(i) for i in ids], limits=limits)

    def _record(
        self,
        where: str,
        prompt: str,
        prompt_ids: list[int],
        label: Any,
        metadata: Any,
        chat: list[dict[str, Any]] | None,
        tools: Any,
        limits: dict[str, int],
        labels_required: bool,
        reward: RewardConfig | None,
        images: list[str],
    ) -> PromptRecord | str:
        """Row `where` checked and ready, or the name of the length limit that drops it."""
        config = self.config
        if not prompt_ids:
            raise ValueError(
                f"{where}: renders to an empty prompt (column {config.input_key!r}); "
                "remove the row or fill it in"
            )
        row_metadata = _metadata_dict(where, metadata, config)
        needs_label = labels_required
        if reward is not None:
            own = check_row_reward(where, row_metadata, reward)
            needs_label = own.reads_label
            if own != SampleReward.of_config(reward):
                self.own_rewards.setdefault(own, where)
        if needs_label and label is None:
            raise ValueError(
                f"{where}: no label (column {config.label_key!r}), and the reward "
                "compares answers with it; fill it in or remove the row"
            )
        reason = next((r for r, limit in limits.items() if len(prompt_ids) > limit), None)
        if reason is not None:
            if config.strict_data:
                raise ValueError(
                    f"{where}: the prompt has {len(prompt_ids)} tokens, over {reason} "
                    f"({limits[reason]}); shorten or remove the row, or drop --strict-data "
                    "to skip such rows"
                )
            return reason
        return PromptRecord(
            prompt=prompt,
            prompt_ids=list(prompt_ids),
            label=_label_text(label),
            metadata=row_metadata,
            messages=chat,
            tools=_tool_names(where, tools, config),
            images=tuple(images),
        )

    def _report_filter(self, *, total: int, lengths: list[int], limits: dict[str, int]) -> None:
        for reason, count in self.dropped_by.items():
            if not count:
                continue
            own_limit = reason.startswith("--rollout-max-prompt-len")
            hint = "" if own_limit else "--rollout-max-prompt-len sets a lower limit; "
            logger.warning(
                "dropped %d of %d prompts from %s: longer than %s (%d tokens; longest prompt: "
                "%d); %s--strict-data refuses such data instead",
                count, total, self.config.prompt_data, reason, limits[reason], max(lengths), hint,
            )  # fmt: skip
        if not self._records:
            dropped = ", ".join(f"{n} by {reason}" for reason, n in self.dropped_by.items() if n)
            raise ValueError(
                f"--prompt-data {self.config.prompt_data}: no prompts left: all {total} rows were "
                f"dropped ({dropped}; longest prompt: {max(lengths)} tokens, shortest: "
                f"{min(lengths)}); raise --rollout-max-prompt-len or shorten the prompts"
            )
        logger.info(
            "loaded %d prompts from %s (%d dropped)",
            len(self._records),
            self.config.prompt_data,
            self.dropped,
        )

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, i: int) -> PromptRecord:
        return self._records[i]


MAX_REPORTED_ROWS = 20
"""How many bad rows one error lists; the count covers all of them."""


class _BadRows:
    """The rows of one file that cannot be used, found in one pass and refused together."""

    def __init__(self, prompt_data: str) -> None:
        self.prompt_data = prompt_data
        self.rows: set[int] = set()
        self.messages: list[str] = []

    def __contains__(self, row: int) -> bool:
        return row in self.rows

    def attempt(self, row: int, check: Any, *args: Any) -> Any:
        """`check(*args)`, or None (the row noted bad) where it raises ValueError."""
        try:
            return check(*args)
        except ValueError as err:
            self.rows.add(row)
            if len(self.messages) < MAX_REPORTED_ROWS:
                self.messages.append(str(err))
            return None

    def raise_if_any(self) -> None:
        if not self.rows:
            return
        if len(self.rows) == 1:
            raise ValueError(self.messages[0])
        shown = f" (the first {MAX_REPORTED_ROWS})" if len(self.rows) > MAX_REPORTED_ROWS else ""
        raise ValueError(
            f"--prompt-data {self.prompt_data}: {len(self.rows)} rows cannot be used{shown}; fix "
            "them and run again:\n  " + "\n  ".join(self.messages)
        )


def _read_table(path: Path) -> tuple[datasets.Dataset, list[int] | None]:
    """The file's rows, and for JSONL the 1-based file line of each row."""
    # Imported here: `datasets` (with pandas and pyarrow) takes seconds to import, and the
    # configuration imports this module for DataSourceConfig.
    import datasets

    if not path.is_file():
        raise FileNotFoundError(
            f"--prompt-data {str(path)!r} does not exist or is not a file; "
            "pass the path of a local .jsonl, .json or .parquet file"
        )
    builder = _BUILDERS[path.suffix.lower()]
    # Checked here, by line: the readers behind `datasets` count rows from 0 or name nothing.
    lines = _jsonl_row_lines(path, builder) if path.suffix.lower() == ".jsonl" else None
    no_rows = f"--prompt-data {path} has no rows; it must hold at least one prompt"
    try:
        table = datasets.load_dataset(builder, data_files=str(path), split="train")
    except StopIteration:
        # What `datasets` raises when a JSON file yields no table at all (empty or blank file).
        raise ValueError(no_rows) from None
    except datasets.exceptions.DatasetGenerationError as err:
        # The useful part (e.g. Arrow's "JSON parse error" with its position) is the cause.
        raise ValueError(
            f"--prompt-data {path}: cannot read it as {builder}: {err.__cause__ or err}"
        ) from err
    if len(table) == 0:
        raise ValueError(no_rows)
    return table, lines


def _length_limits(max_prompt_len: int | None, context_length: int | None) -> dict[str, int]:
    """The prompt-length limits in force, by the name a message gives them."""
    limits = {}
    if max_prompt_len is not None:
        limits[f"--rollout-max-prompt-len {max_prompt_len}"] = max_prompt_len
    if context_length is not None:
        # A prompt must leave room for one generated token.
        limits["the model's context"] = context_length - 1
    return limits


def _row_locations(path: Path, num_rows: int, lines: list[int] | None) -> list[str]:
    """How an error names each row: `file:line` (1-based) for JSONL, whose rows are its non-blank
    lines; `file row N` (1-based) for JSON arrays and Parquet."""
    if lines is not None and len(lines) == num_rows:
        return [f"--prompt-data {path}:{number}" for number in lines]
    return [f"--prompt-data {path} row {row + 1}" for row in range(num_rows)]


def _jsonl_row_lines(path: Path, builder: str) -> list[int]:
    """The 1-based line of each row (non-blank line) of a JSONL file; a line that is not a JSON
    object is refused naming it."""
    lines = []
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as err:
                why = str(err)
            else:
                why = "" if isinstance(row, dict) else f"a JSON {type(row).__name__}, not an object"
            if why:
                raise ValueError(
                    f"--prompt-data {path}: cannot read it as {builder}: line {number}: {why}"
                )
            lines.append(number)
    return lines


def _require_column(key: str, flag: str, config: DataSourceConfig, columns: list[str]) -> str:
    if key not in columns:
        extra = " (or unset it for a task without labels)" if flag == "--label-key" else ""
        raise ValueError(
            f"{flag} {key!r} is not a column of --prompt-data {config.prompt_data}; "
            f"its columns are {columns}: pass one of them{extra}"
        )
    return key


def _metadata_column(
    table: datasets.Dataset, config: DataSourceConfig, columns: list[str]
) -> list[Any]:
    key = config.metadata_key
    if key is None or (key == _DEFAULT_METADATA_KEY and key not in columns):
        return [None] * len(table)
    return table[_require_column(key, "--metadata-key", config, columns)]


def _messages(location: str, value: Any, config: DataSourceConfig) -> list[dict] | None:
    """The row's prompt as chat messages (a string becomes one user message); None when it is
    used as plain text (no --apply-chat-template)."""
    where = f"{location}, column {config.input_key!r}"
    if isinstance(value, str):
        return [{"role": "user", "content": value}] if config.apply_chat_template else None
    if isinstance(value, list) and all(_is_message(m) for m in value) and value:
        if not config.apply_chat_template:
            raise ValueError(
                f"{where} holds chat messages, which need a chat template to become a prompt; "
                "pass --apply-chat-template"
            )
        return value
    raise ValueError(
        f"{where} must be a string or a non-empty list of {{'role': str, 'content': str}} "
        f"messages, got {_describe(value)}"
    )


def _render(
    location: str,
    value: Any,
    messages: list[dict] | None,
    tokenizer: Any,
    template: ChatTemplate | None,
) -> str:
    """The prompt text of one row: the string itself, or its messages through the chat template."""
    if messages is None:
        return value
    assert template is not None  # set whenever apply_chat_template is
    try:
        return template.render(tokenizer, messages)
    except Exception as err:  # jinja's errors, the template's own raise_exception
        raise ValueError(
            f"{location}: the chat template cannot render this row: {type(err).__name__}: {err}"
        ) from None


def _tool_names(location: str, value: Any, config: DataSourceConfig) -> list[str] | None:
    if config.tool_key is None:
        return None
    if not (isinstance(value, list) and all(isinstance(name, str) for name in value)):
        raise ValueError(
            f"{location}, column {config.tool_key!r} (--tool-key) must be a list of tool names, "
            f"got {_describe(value)}"
        )
    return list(value)


def _is_message(value: Any) -> bool:
    """A chat message: a role and a string content, or a list of text and image parts."""
    if not (isinstance(value, dict) and isinstance(value.get("role"), str)):
        return False
    content = value.get("content")
    return isinstance(content, str) or (
        isinstance(content, list)
        and all(
            isinstance(p, dict) and p.get("type") in ("text", *IMAGE_PART_TYPES) for p in content
        )
    )


def _image_prompt_ids(where: str, processor: Any, prompt: str, images: list[str]) -> list[int]:
    """The token ids of a prompt with images, as the model's processor makes them."""
    try:
        return processor_prompt_ids(processor, prompt, images)
    except (ValueError, TypeError) as err:  # e.g. placeholders and images disagree
        raise ValueError(f"{where}: the model's processor refuses the row: {err}") from None


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


def _label_text(value: Any) -> str | None:
    # Reward functions compare text; numbers and structures keep a parseable form.
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def _metadata_dict(location: str, value: Any, config: DataSourceConfig) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(
            f"{location}: --metadata-key column {config.metadata_key!r} must hold a dict (or "
            f"null), got {_describe(value)}"
        )
    return value
