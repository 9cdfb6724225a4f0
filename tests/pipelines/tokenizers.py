"""Tokenizers for the image_text tests (--pipeline-arg tokenizer=tests/pipelines/tokenizers.py:byte_ids): each a
callable from a caption to token ids, as a user's would be."""


def byte_ids(text: str) -> list[int]:
    """Each UTF-8 byte plus one, so 0 stays free and the caption comes back from the ids: a reversible toy."""
    return [b + 1 for b in text.encode("utf-8")]


def hugging_face_style(text: str) -> dict[str, list[int]]:
    """What a Hugging Face tokenizer's ``__call__`` returns: a mapping holding ``input_ids``."""
    return {"input_ids": byte_ids(text), "attention_mask": [1] * len(text.encode("utf-8"))}
