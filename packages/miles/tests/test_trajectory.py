"""Token-exact multi-turn trajectories: what training sees is the ids the engine read and wrote."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint
from miles.backends.training_utils.batching.sample import Sample
from miles.rollout.chat_template import ChatTemplate
from miles.rollout.chat_turns import ChatTurns
from miles.rollout.trajectory import Trajectory

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(build_tiny_checkpoint(tmp_path_factory.mktemp("tok")))


texts = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="<>|"), max_size=24)
turns = st.lists(
    st.tuples(
        texts,  # the model's answer
        st.lists(st.tuples(st.sampled_from(["tool", "user"]), texts), min_size=1, max_size=2),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=40, deadline=None)
@given(question=texts, exchange=turns, with_tools=st.booleans())
def test_a_conversation_is_the_engines_ids_and_only_the_models_are_trained(
    tokenizer, question, exchange, with_tools
):
    chat = ChatTurns(tokenizer, ChatTemplate(), TOOLS if with_tools else None)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    messages = [{"role": "user", "content": question}]
    trajectory = Trajectory(chat.first(messages))
    sent, produced = [], []  # what the engine was given each turn, what it answered
    for answer, followers in exchange:
        sent.append(trajectory.ids)
        completion = [*chat.encode(answer), im_end]  # the model ends its turn, as Qwen's do
        produced.append(completion)
        trajectory.add_completion(completion, [-0.5] * len(completion))
        messages.append({"role": "assistant", "content": answer})
        new = [{"role": role, "content": text} for role, text in followers]
        trajectory.add_context(chat.after(completion, new))
        messages += new
    # Every turn's prompt is the whole exchange before it: nothing was re-rendered.
    final = trajectory.ids
    for prompt, completion in zip(sent, produced, strict=True):
        assert final[: len(prompt) + len(completion)] == prompt + completion
    # The loss mask covers exactly the completions, with their log-probs.
    trained = [t for t, m in zip(trajectory.response_ids, trajectory.loss_mask, strict=True) if m]
    assert trained == [t for completion in produced for t in completion]
    assert [lp for lp, m in zip(trajectory.log_probs, trajectory.loss_mask, strict=True) if m] == (
        [-0.5] * len(trained)
    )
    # With answers the template writes as sampled, the rendering agrees token for token.
    assert chat.matches_template(messages, final)
    sample = trajectory.fill(Sample(index=0))
    assert sample.tokens == final and sample.effective_loss_mask == trajectory.loss_mask


def test_the_recorded_tokens_win_where_the_template_would_rewrite_an_answer(tokenizer, tmp_path):
    # A template that drops earlier reasoning, as Qwen3's does: re-rendering loses sampled tokens.
    forgetful = ChatTemplate(
        template=(
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{{ m['content'].split('</think>')[-1] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        )
    )
    chat = ChatTurns(tokenizer, forgetful)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    messages = [{"role": "user", "content": "2+3?"}]
    trajectory = Trajectory(chat.first(messages))
    answer = "<think>add them</think>5"
    completion = [*chat.encode(answer), im_end]
    trajectory.add_completion(completion, [0.0] * len(completion))
    follow = [{"role": "user", "content": "and 3+4?"}]
    trajectory.add_context(chat.after(completion, follow))
    messages += [{"role": "assistant", "content": answer}, *follow]
    assert not chat.matches_template(messages, trajectory.ids)  # counted as a mismatch
    assert tokenizer.decode(trajectory.ids).count("add them") == 1  # the sampled reasoning stays


def test_a_turn_the_model_did_not_end_is_closed_before_the_next(tokenizer):
    chat = ChatTurns(tokenizer, ChatTemplate())
    assert chat.turn_end == "<|im_end|>\n"
    cut = chat.encode("an answer cut by the length limi")
    after = tokenizer.decode(chat.after(cut, [{"role": "user", "content": "go on"}]))
    assert after == "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"


def test_earlier_turns_written_otherwise_later_are_kept_as_sampled_and_counted(tokenizer):
    # Qwen3 writes an empty thinking block into the last answer only, and a header here counts
    # the messages: both change text before the new turn, which stays as it was recorded.
    shifting = ChatTemplate(
        template=(
            "{{ messages | length }} messages\n{% for m in messages %}"
            "{% if m['role'] == 'assistant' and loop.last %}<think></think>{% endif %}"
            "{{ m['content'] }}<|im_end|>{% endfor %}"
        )
    )
    chat = ChatTurns(tokenizer, shifting)
    messages = [{"role": "user", "content": "q"}]
    trajectory = Trajectory(chat.first(messages))
    completion = [*chat.encode("a"), tokenizer.convert_tokens_to_ids("<|im_end|>")]
    trajectory.add_completion(completion, [0.0] * len(completion))
    trajectory.add_context(chat.after(completion, [{"role": "user", "content": "r"}]))
    assert tokenizer.decode(trajectory.ids) == "1 messages\nq<|im_end|>a<|im_end|>r<|im_end|>"
    messages += [{"role": "assistant", "content": "a"}, {"role": "user", "content": "r"}]
    assert not chat.matches_template(messages, trajectory.ids)


def test_a_template_that_ends_turns_otherwise_once_followed_is_refused_at_once(tokenizer):
    ragged = ChatTemplate(
        template="{% for m in messages %}{{ m['content'] }}{{ '.' if loop.last else ';' }}{% endfor %}"
    )
    with pytest.raises(ValueError, match="does not end an assistant turn the same way"):
        ChatTurns(tokenizer, ragged)


def test_a_special_token_inside_the_turn_end_closes_it_once(tokenizer):
    # Llama 2 ends a turn with " </s>": the model's </s> is that end, not text before another.
    spaced = ChatTemplate(
        template=(
            "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} <|endoftext|>{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}"
        )
    )
    chat = ChatTurns(tokenizer, spaced)
    assert chat.turn_end == " <|endoftext|>"
    ended = [*chat.encode("hi "), tokenizer.eos_token_id]
    assert tokenizer.decode(chat.after(ended, [{"role": "user", "content": "more"}])) == (
        "[user] more <|endoftext|>[assistant] "
    )
    cut = chat.encode("hi>")  # cut off: a character of the turn end is not the end
    assert tokenizer.decode(chat.after(cut, [{"role": "user", "content": "more"}])) == (
        " <|endoftext|>[user] more <|endoftext|>[assistant] "
    )


def test_context_needs_a_completion_first_and_log_probs_match_the_ids():
    trajectory = Trajectory([1, 2])
    with pytest.raises(ValueError, match="belongs in the prompt"):
        trajectory.add_context([3])
    with pytest.raises(ValueError, match="2 tokens came with 1 log-probs"):
        trajectory.add_completion([3, 4], [0.0])
