"""A model folder's tokenizer from tokenizer.json with the `tokenizers` library alone (no transformers).

The gateway's image leaves transformers out (and numpy, which it pulls in: ~75 MB of the image), so
the gateway loads tokenizer.json with `tokenizers` and renders chat templates with jinja2
(gateway/chat_template.py). `FastTokenizer` is the part of transformers'
`PreTrainedTokenizerFast` the gateway touches (encode, decode, the vocabulary, the chat template,
`backend_tokenizer` for the Rust DecodeStream), giving the same ids and text: transformers 5 loads
such a folder into the same Rust tokenizer and adds nothing to it for the tokenizer classes in
`_VERIFIED_CLASSES` with the settings `_unverified` checks. Anything else (another class, with its
own defaults and pipeline edits; truncation or padding in tokenizer.json; extra added tokens) goes
to transformers where it is installed, with a log line; without it (the gateway image) the fast
path still serves, with a warning, since it is the only loader there.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from gateway import chat_template

log = logging.getLogger(__name__)

# transformers' SPECIAL_TOKENS_ATTRIBUTES: what templates see as bos_token, eos_token, ...
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Classes whose transformers loader keeps tokenizer.json's pipeline as is and has no default tokens.
_VERIFIED_CLASSES = (None, "TokenizersBackend", "PreTrainedTokenizerFast")
# Settings by which transformers edits the pipeline or the special tokens.
_EDITING_KEYS = ("add_prefix_space", "split_special_tokens", "from_slow")
# Lists of further special tokens (transformers 5's name, and the older one).
_EXTRA_KEYS = ("extra_special_tokens", "additional_special_tokens")


def _token_text(value: Any) -> str | None:
    """A special token as the config writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _clean_up(text: str) -> str:
    """transformers' `clean_up_tokenization` (for WordPiece-era tokenizers that ask for it)."""
    for a, b in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(a, b)
    return text


class FastTokenizer:
    """What the gateway uses of a Hugging Face fast tokenizer, on `tokenizers` and jinja2."""

    def __init__(self, backend: Any, config: dict[str, Any], template: str | dict[str, str] | None) -> None:
        self.backend_tokenizer = backend
        self.chat_template = template
        self.special_tokens_map = {
            k: text for k in SPECIAL_TOKENS if (text := _token_text(config.get(k))) is not None
        }
        # transformers 5 skips the clean-up for BPE (it would eat spaces before punctuation).
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces")) and (
            type(backend.model).__name__ != "BPE"
            or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"))
        )

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, not encode: only the batch call releases the GIL (as transformers' fast
        # tokenizers call it), so a long prompt tokenizing on a worker thread leaves the event
        # loop free to answer everyone else.
        (encoding,) = self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return encoding.ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.clean_up_tokenization_spaces else text

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return self.backend_tokenizer.id_to_token(int(token_id))

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str:
        if tokenize:
            raise ValueError("FastTokenizer renders text only: encode the result (tokenize=False)")
        template = chat_template.pick_template(self.chat_template, tools)
        return chat_template.render(
            template,
            conversation,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **{**self.special_tokens_map, **kwargs},  # kwargs win, as in transformers
        )


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _config(folder: str) -> dict[str, Any]:
    """tokenizer_config.json with special_tokens_map.json over it (transformers' legacy merge)."""
    config = _read_json(os.path.join(folder, "tokenizer_config.json"))
    for key, value in _read_json(os.path.join(folder, "special_tokens_map.json")).items():
        if key in SPECIAL_TOKENS:
            config[key] = value
    return config


def _template(folder: str, config: dict[str, Any]) -> str | dict[str, str] | None:
    """chat_template.jinja (and additional_chat_templates/*.jinja) over the config's entry."""
    templates: dict[str, str] = {}
    main = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(main):
        with open(main, encoding="utf-8") as f:
            templates["default"] = f.read()
    extra = os.path.join(folder, "additional_chat_templates")
    if os.path.isdir(extra):
        for name in sorted(os.listdir(extra)):
            if name.endswith(".jinja"):
                with open(os.path.join(extra, name), encoding="utf-8") as f:
                    templates[name.removesuffix(".jinja")] = f.read()
    if list(templates) == ["default"]:
        return templates["default"]
    if templates:
        return templates
    template = config.get("chat_template")
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template}
    legacy = _read_json(os.path.join(folder, "chat_template.json")).get("chat_template")
    return template if template is not None else legacy


def _unverified(config: dict[str, Any], tokenizer_json: dict[str, Any], backend: Any) -> str | None:
    """Why transformers might tokenize this folder differently from the fast path (None: it won't)."""
    cls = config.get("tokenizer_class")
    if cls not in _VERIFIED_CLASSES:
        return f"tokenizer_class {cls}"
    for key in _EDITING_KEYS:
        if config.get(key):
            return f"tokenizer_config.json sets {key}"
    for key in ("truncation", "padding"):
        if tokenizer_json.get(key) is not None:
            return f"tokenizer.json sets {key}"
    if tokenizer_json.get("post_processor") is None:
        return "tokenizer.json has no post_processor (transformers makes one)"
    known = {(t.get("id"), t.get("content")) for t in tokenizer_json.get("added_tokens", [])}
    for index, token in (config.get("added_tokens_decoder") or {}).items():
        if (int(index), _token_text(token)) not in known:
            return f"added token {index} of tokenizer_config.json is not in tokenizer.json"
    # transformers adds a special token the vocabulary lacks, and marks listed ones special.
    for key in SPECIAL_TOKENS:
        text = _token_text(config.get(key))
        if text is not None and backend.token_to_id(text) is None:
            return f"{key} {text!r} is not in the vocabulary"
    special = {t.get("content") for t in tokenizer_json.get("added_tokens", []) if t.get("special")}
    for key in _EXTRA_KEYS:
        listed = config.get(key) or []
        if not isinstance(listed, list) or any(_token_text(t) not in special for t in listed):
            return f"tokenizer_config.json's {key} are not all special tokens of tokenizer.json"
    return None


def load(folder: str) -> Any:
    """The folder's tokenizer: a FastTokenizer, or transformers' where the fast path may differ.

    None when the folder has no tokenizer.json and transformers is not installed to try the rest
    (tokenizer.model, vocab.json): the caller says the model ships no tokenizer the gateway reads.
    """
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        return _transformers(folder, "no tokenizer.json")
    with open(path, encoding="utf-8") as f:
        tokenizer_json = json.load(f)
    config = _config(folder)
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(path)
    why = _unverified(config, tokenizer_json, backend)
    if why is not None:
        hf = _transformers(folder, why)
        if hf is not None:
            return hf
        log.warning(
            "tokenizer loaded with the tokenizers library although transformers might differ "
            "(transformers is not installed)",
            extra={"model": folder, "reason": why},
        )
    return FastTokenizer(backend, config, _template(folder, config))


def _transformers(folder: str, why: str) -> Any:
    try:
        import transformers  # noqa: F401 - only whether it is installed
    except ImportError:
        return None
    from services.model_files import load_tokenizer

    log.info("tokenizer loaded with transformers", extra={"model": folder, "reason": why})
    return load_tokenizer(folder)
