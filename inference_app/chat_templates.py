"""Where a model's chat template comes from (issue 44), and the turn-end tokens it implies.
No torch here: web checks a registration's template too.

In order: MILLM_CHAT_TEMPLATE or a catalogue entry's `chat_template` (a well-known template's
name, or a path to a Jinja file), then the model's own (a GGUF's `tokenizer.chat_template`
metadata, a folder's `tokenizer_config.json` or `chat_template.jinja`: transformers reads both).
A model with neither answers chat with a 400 naming the setting (`missing`), and its completions,
scoring and embeddings work as before.

The named templates are the formats the model families publish (ChatML for SmolLM and Qwen,
Gemma's turns, Llama 3's headers, Phi-3's tags, Mistral's [INST]), written as Jinja files beside
this module: no well-kept Python library ships them apart from a whole inference server.

A template marks the end of the assistant's turn with a token of its own (`<end_of_turn>`,
`<|im_end|>`...) that a GGUF's metadata may not list as end of sequence: generation stops at it
too, as llama.cpp's end-of-generation tokens do.
"""

from dataclasses import dataclass
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from millm_lib.errors import ApiError

FOLDER = Path(__file__).resolve().parent / "chat_template_files"
SETTING = "MILLM_CHAT_TEMPLATE"
# Tokens that end a turn in the well-known formats; each one the template writes and the
# vocabulary has as a single token stops generation.
TURN_ENDS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "<|end_of_text|>")


def names():
    return sorted(path.stem for path in FOLDER.glob("*.jinja"))


@dataclass(frozen=True)
class ChatTemplate:
    text: str | None
    origin: str  # the start-up line's words: where the template came from

    @property
    def present(self):
        return self.text is not None


def check_setting(value, field=SETTING):
    """The template `value` names (a name of `names()` or a Jinja file's path) as text;
    ImproperlyConfigured naming `field` when it names neither."""
    if value in names():
        return (FOLDER / f"{value}.jinja").read_text()
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ImproperlyConfigured(f"{field} {value!r} cannot be read: {error}") from None
    raise ImproperlyConfigured(
        f"{field} must name a well-known chat template ({', '.join(names())}) or a Jinja file's path; "
        f"got {value!r} ({len(value):,} characters), which is neither")


def resolve(tokenizer, setting):
    """The template a model chats with: `setting` (a name or a path) over the model's own."""
    if setting:
        named = setting in names()
        return ChatTemplate(check_setting(setting), f"'{setting}' ({'well-known' if named else 'a Jinja file'})")
    own = tokenizer.chat_template
    if isinstance(own, dict):  # a folder may name several; the default is the one chat uses
        own = own.get("default")
    if own:
        return ChatTemplate(own, "the model's own")
    return ChatTemplate(None, f"none (chat answers 400 until {SETTING} is set)")


def apply(tokenizer, template):
    """Make `template` the tokenizer's, so apply_chat_template renders with it."""
    if template.present:
        tokenizer.chat_template = template.text


def turn_end_ids(tokenizer, template):
    """The ids of the turn-end tokens `template` writes that are single tokens of the vocabulary."""
    if not template.present:
        return set()
    vocabulary = tokenizer.get_vocab()
    return {vocabulary[token] for token in TURN_ENDS if token in template.text and token in vocabulary}


def missing(model_id):
    return ApiError(
        400, "chat_template_missing",
        f"The model '{model_id}' has no chat template (its file names none), so it cannot chat: set "
        f"{SETTING} to a template's name ({', '.join(names())}) or a Jinja file's path, or register it "
        f"with POST /api/models and a `chat_template`. /v1/completions answers without one.",
        param="messages",
    )
