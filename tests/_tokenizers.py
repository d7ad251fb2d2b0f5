"""Tokenizers that put special tokens around each text, as Llama's puts its BOS before one."""

from tokenizers.processors import TemplateProcessing


def put_around_each_text(backend, template: str) -> dict[str, int]:
    """Make the `tokenizers` backend put the special tokens of `template` (TemplateProcessing's single form, say
    "<s> $A") around each text it encodes, adding those it lacks; returns their ids by name."""
    names = [name for name in template.split() if name != "$A"]
    backend.add_special_tokens(names)
    ids = {name: backend.token_to_id(name) for name in names}
    backend.post_processor = TemplateProcessing(single=template, special_tokens=list(ids.items()))
    return ids
