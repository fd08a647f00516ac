"""A conversation through the model's chat template: the checks and errors `LLM.chat` and the server's chat
completions share."""

# apply_chat_template's own arguments, which chat_template_kwargs may not set (they are not template variables)
TEMPLATE_ARGS = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                 "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                 "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"}


class ChatTemplateError(ValueError):
    """A conversation that cannot become a prompt; param names the field to change (None: the model's setup)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def render(tokenizer, conversation: list[dict], chat_template: str | None, tools: list[dict] | None,
           add_generation_prompt: bool, continue_final_message: bool, variables: dict | None,
           no_template_hint: str) -> tuple[str, list[int]]:
    """(the prompt text, its token ids). no_template_hint: what to do instead when the model has no template."""
    if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise ChatTemplateError(f"this model has no chat template; {no_template_hint}")
    if not conversation:
        raise ChatTemplateError("messages is empty", "messages")
    conversation = [_with_text_content(m, i) for i, m in enumerate(conversation)]
    if add_generation_prompt and continue_final_message:
        raise ChatTemplateError("continue_final_message continues the last message: set add_generation_prompt to "
                                "False (false in JSON) with it", "continue_final_message")
    variables = variables or {}
    if not isinstance(variables, dict):
        raise ChatTemplateError(f"chat_template_kwargs must map the template's variables to values, not "
                                f"{type(variables).__name__}", "chat_template_kwargs")
    if taken := sorted(set(variables) & TEMPLATE_ARGS):
        raise ChatTemplateError(f"chat_template_kwargs: {', '.join(taken)} are the request's own fields, not the "
                                "template's variables", "chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False, chat_template=chat_template,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **variables)
    except Exception as e:  # a template may reject a conversation (roles out of order, ...)
        raise ChatTemplateError(f"the chat template rejected these messages: {e}", "messages") from None
    # The template already holds any BOS token, so don't add special tokens again.
    return text, tokenizer.encode(text, add_special_tokens=False)


def _with_text_content(message, i: int) -> dict:
    """The message with OpenAI's content parts as one text (the text parts joined by newlines), as vLLM's."""
    if not isinstance(message, dict):
        raise ChatTemplateError(f"messages[{i}] must be a dict with 'role' and 'content', not "
                                f"{type(message).__name__}", "messages")
    content = message.get("content")
    if isinstance(content, list):
        if any(not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str)
               for part in content):
            raise ChatTemplateError(f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": "
                                    "...}}) are supported (of a vision-language checkpoint, pipellm runs the text "
                                    "model alone)", "messages")
        return message | {"content": "\n".join(part["text"] for part in content)}
    if content is not None and not isinstance(content, str):
        raise ChatTemplateError(f"messages[{i}].content must be a string or a list of text parts, not "
                                f"{type(content).__name__}", "messages")
    return message
