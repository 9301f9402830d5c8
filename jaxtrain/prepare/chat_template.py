"""Chat templates for `jaxtrain prepare --chat`: where a tokenizer's template is found, and
rendering it exactly as transformers' `apply_chat_template` does (a sandboxed jinja2
environment with trim_blocks and lstrip_blocks, the loopcontrols extension, its `tojson`,
`raise_exception` and `strftime_now`, and the tokenizer's bos_token/eos_token), so that the
ids equal `tokenizer.apply_chat_template(messages, tokenize=True)`.

A template comes from `--chat-template` (a file, or the name of one shipped in templates/,
e.g. `chatml`), else from the tokenizer's own files (`chat_template.jinja`, or
`chat_template` in tokenizer_config.json, as transformers saves them). It is stored with the
dataset's tokenizer as `tokenizer/chat_template.jinja`, where transformers looks for it too.

`{% generation %}...{% endgeneration %}` blocks (TRL's training templates) are tracked as
transformers tracks them for `return_assistant_tokens_mask`: `render_tracked` gives the
[start, end) characters each block wrote, which then define the loss mask (chat.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import pathlib
import re
from contextvars import ContextVar

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jaxtrain.errors import DataError

TEMPLATE_FILE = "chat_template.jinja"
SHIPPED = pathlib.Path(__file__).parent / "templates"
# as TRL's has_generation_markers spells the tag, trim variants included
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# While render_tracked runs: (the pieces written so far, the blocks' [start, end))
_TRACKING: ContextVar[tuple[list, list] | None] = ContextVar("generation_tracking",
                                                             default=None)


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A template's source and the special-token strings it may name."""

    source: str
    bos_token: str | None = None
    eos_token: str | None = None

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()

    @property
    def has_generation(self) -> bool:
        """Whether the template marks what is trained with {% generation %} blocks."""
        return _GENERATION_TAG.search(self.source) is not None

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as text; jinja2.TemplateError when the template refuses it."""
        return _compiled(self.source).render(**self._variables(messages, add_generation_prompt))

    def render_tracked(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """(the conversation as text, [start, end) in characters of the output of each
        {% generation %} block), the pieces streamed as transformers' apply_chat_template
        streams them, so that the spans are its generation indices."""
        pieces, spans = [], []
        token = _TRACKING.set((pieces, spans))
        try:
            for piece in _compiled(self.source).generate(**self._variables(messages, False)):
                pieces.append(piece)
        finally:
            _TRACKING.reset(token)
        return "".join(pieces), spans

    def _variables(self, messages: list[dict], add_generation_prompt: bool) -> dict:
        return {"messages": messages, "add_generation_prompt": add_generation_prompt,
                "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}


def shipped_names() -> list[str]:
    return sorted(p.stem for p in SHIPPED.glob("*.jinja"))


def find(option: str | None, tokenizer_spec: str | None, tokenizer) -> ChatTemplate:
    """The template of a --chat prepare: --chat-template (a file or a shipped name), else
    the tokenizer directory's own; DataError (one line) when there is none."""
    config = _tokenizer_config(tokenizer_spec)
    tokens = {role: _token_string(config.get(f"{role}_token"), getattr(tokenizer, f"{role}_id"),
                                  tokenizer) for role in ("bos", "eos")}
    if option:
        path = SHIPPED / f"{option}.jinja" if option in shipped_names() else pathlib.Path(option)
        if not path.is_file():
            raise DataError(f"--chat-template={option}: no such file, and no shipped template "
                            f"of that name (shipped: {', '.join(shipped_names())})")
        return ChatTemplate(path.read_text(), tokens["bos"], tokens["eos"])
    source = _own_template(tokenizer_spec, config)
    if source is None:
        raise DataError(f"--chat: the tokenizer ({tokenizer.describe()}) has no chat "
                        "template; give --chat-template FILE or a shipped one "
                        f"({', '.join(shipped_names())})")
    return ChatTemplate(source, tokens["bos"], tokens["eos"])


def own_source(directory) -> str | None:
    """The chat template a tokenizer directory carries (chat_template.jinja, or
    tokenizer_config.json's), None if it has none: what an import keeps with the run's
    tokenizer, so that `generate --chat` and `serve` render as the model's files say."""
    return _own_template(str(directory), _tokenizer_config(str(directory)))


def _directory(spec: str | None) -> pathlib.Path | None:
    if not spec:
        return None
    path = pathlib.Path(spec)
    return path if path.is_dir() else path.parent if path.is_file() else None


def _tokenizer_config(spec: str | None) -> dict:
    directory = _directory(spec)
    if directory is None or not (directory / "tokenizer_config.json").is_file():
        return {}
    try:
        return json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{directory / 'tokenizer_config.json'}: unreadable ({e})") from None


def _own_template(spec: str | None, config: dict) -> str | None:
    """chat_template.jinja beside the tokenizer (transformers >= 4.43 saves it so), else
    tokenizer_config.json's chat_template (a string, or named templates: 'default')."""
    directory = _directory(spec)
    if directory is not None and (directory / TEMPLATE_FILE).is_file():
        return (directory / TEMPLATE_FILE).read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_string(value, token_id: int | None, tokenizer) -> str | None:
    """A special token's text: tokenizer_config.json's, else the id's own piece."""
    if isinstance(value, dict):
        value = value.get("content")
    if isinstance(value, str):
        return value
    if token_id is None:
        return None
    return tokenizer.decode([token_id])


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (TRL-style templates) renders its body, and
    under render_tracked records where it starts and ends in the output."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        body = caller()
        tracking = _TRACKING.get()
        if tracking is not None:
            pieces, spans = tracking
            start = sum(map(len, pieces))
            spans.append((start, start + len(body)))
        return body


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compiled(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise DataError(f"the chat template does not parse: {e.message} (line {e.lineno})") \
            from None
