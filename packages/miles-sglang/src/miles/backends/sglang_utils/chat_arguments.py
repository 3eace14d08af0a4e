"""The arguments transformers' `apply_chat_template` takes itself. Template variables given by a
user (--apply-chat-template-kwargs) or a client (`chat_template_kwargs`) may not shadow them: one
would swap the model's template, or change what is rendered, instead of setting a variable."""

TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip
