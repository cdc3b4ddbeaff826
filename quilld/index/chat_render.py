"""A request turned into the token ids vLLM 0.33's OpenAI server feeds its engine, without vLLM.

An engine family's Hugging Face tokenizer directory is loaded once (`load`, cached per
directory) into a `ChatTokenizer`: `tokenizer.json` (the `tokenizers` package), the chat
template (`chat_template.jinja` if present, else `tokenizer_config.json`'s `chat_template`,
a string or a list of named templates) and the named special tokens the template sees
(`bos_token`, `eos_token`, ...). Everything here is plain sync code: a caller on the event
loop runs it in an executor. It needs the `gateway` extra (jinja2, tokenizers), so the gateway
imports it only for an engine whose `tokenizer` names a directory.

What vLLM does, and so what this does:

- chat (`chat_token_ids`): the messages are parsed as vLLM parses text-only messages for a
  template of the "string" content format (content parts joined by newlines, `tool_calls`
  arguments decoded to objects, `developer` turned into `system` when the template does not
  name it), normalized as transformers' `apply_chat_template` does (keys whose value is None
  dropped; `reasoning_content`/`thinking` filled from `reasoning`), rendered in transformers'
  Jinja environment (an `ImmutableSandboxedEnvironment` with `trim_blocks`, `lstrip_blocks`,
  the `loopcontrols` extension and `{% generation %}` blocks, `raise_exception`, its own
  `tojson`, `strftime_now`), then encoded with `add_special_tokens=False`: the template writes
  the BOS itself. `add_generation_prompt` defaults to True as in vLLM's chat request;
  `continue_final_message` cuts the rendered text after the last message's content as
  transformers does.
- completions (`prompt_token_ids`): the text encoded with `add_special_tokens=True`, i.e.
  through tokenizer.json's post-processor. transformers 5 ignores `tokenizer_config.json`'s
  `add_bos_token`/`add_eos_token` when a tokenizer.json exists, and so does this; a
  tokenizer.json with no post-processor adds nothing.

Refused (`NotCovered`, so a caller can fall back to its own hashing): requests with `tools` or
`documents` (not yet checked against vLLM, nor a template's `tool_use` variant) and multimodal
content parts, and chats for a template that loops over content parts (vLLM's "openai" content
format: vLLM tells it from the template's syntax tree and hands such a template the parts as a
list; `walks_content_parts` errs towards refusing). Not detected, so not refused: a
model-specific tokenizer class whose pipeline differs from its tokenizer.json (transformers 5
rebuilds e.g. Qwen2Tokenizer from vocab and merges; published models ship a tokenizer.json
equal to it), truncation (`truncate_prompt_tokens`) and a chat request's
`add_special_tokens=True`. tests/unit/test_chat_render.py checks all of this against token
ids made by transformers and vLLM (tools/make_chat_render_fixtures.py).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
from tokenizers import AddedToken, Tokenizer

from quilld.errors import CommandError, ConfigError
from quilld.index.token_segments import SegmentCache

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for continue_final_message
_BILLING_HEADER = "x-anthropic-billing-header"  # vLLM drops this first line of a system text part
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_FORBIDDEN_KWARGS = frozenset({"chat_template", "tokenize"})  # vLLM refuses these in chat_template_kwargs
_UNCHECKED_KWARGS = frozenset({"tools", "documents"})  # not yet checked against vLLM: refused, never guessed
LOADED_DIRS = 32  # tokenizer directories kept loaded (one per engine family in practice)


class TemplateUnavailable(ConfigError):
    """A tokenizer directory that cannot render chats: no tokenizer.json, no template, a broken one."""


class TemplateRejected(CommandError):
    """The chat template refused the request (its `raise_exception`), or the request is malformed."""


class NotCovered(CommandError):
    """A request this renderer does not reproduce (multimodal content and the like)."""


class _Generation(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` block, rendered as its body (only the
    assistant-mask bookkeeping, not kept here, differs)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict` as templates see it: a call and `fromkeys`, no attribute access to the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` refusing underscore names, as transformers' is."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_Namespace)
    return env


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _plain(value: Any) -> Any:
    """What the template may see: JSON types only (transformers' `_plain_template_data`)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    return f"<{type(value).__name__}>"


def _text_of(role: str, content: Any) -> str:
    """A message's content as vLLM's "string" content format makes it: its text parts joined by newlines."""
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [content]
    elif isinstance(content, list):
        parts = content
    else:
        raise TemplateRejected(f"a {role} message's content must be a string or a list of content parts")
    texts: list[str] = []
    for part in parts:
        if isinstance(part, str):
            text = part
        elif isinstance(part, Mapping) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
            text = part["text"]
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise NotCovered(f"content parts of type {kind!r} (multimodal) are not rendered by quilld")
        if role == "system" and text.startswith(_BILLING_HEADER):
            text = text.partition("\n")[2]
            if not text:
                continue
        texts.append(text)
    return "\n".join(texts)


def _tool_calls(calls: Any) -> list[dict]:
    """An assistant's tool calls with their arguments decoded to objects, as vLLM passes them."""
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(call, Mapping) or call.get("type", "function") != "function" or not isinstance(fn, Mapping):
            raise TemplateRejected("chat completions only support assistant tool_calls of type 'function'")
        fn = dict(fn)
        args = fn.get("arguments")
        if not args:
            fn["arguments"] = {}
        elif not isinstance(args, dict):
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    args = None
            fn["arguments"] = args if isinstance(args, dict) else {}
        out.append({**call, "function": fn})
    return out


def _conversation(messages: Sequence[Mapping[str, Any]], template: str) -> list[dict[str, Any]]:
    """Messages as vLLM's parser and transformers' normalization hand them to the template."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise TemplateRejected("messages must be a non-empty list of message objects")
    out: list[dict[str, Any]] = []
    for m in messages:
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise TemplateRejected("each message must be an object with a string `role`")
        role = m["role"]
        msg: dict[str, Any] = {"role": role, "content": _text_of(role, m.get("content"))}
        if role == "assistant":
            if m.get("tool_calls") is not None:
                calls = _tool_calls(m["tool_calls"])
                if calls:
                    msg["tool_calls"] = calls
            if m.get("reasoning") is not None:
                msg["reasoning"] = msg["reasoning_content"] = m["reasoning"]
        elif role == "tool" and "tool_call_id" in m:
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if isinstance(m.get("task"), str):
            msg["task"] = m["task"]
        if role == "developer":
            msg["tools"] = m.get("tools")
        out.append(msg)
    if any(m["role"] == "developer" for m in out) and '"developer"' not in template and "'developer'" not in template:
        out = _developer_as_system(out)
    plain = []
    for msg in out:
        msg = {k: v for k, v in _plain(msg).items() if v is not None}
        reasoning = next((msg[k] for k in _REASONING_FIELDS if msg.get(k) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        plain.append(msg)
    return plain


def _developer_as_system(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's rewrite for a template that knows no `developer` role: system messages, merged into one
    at the front when there is more than one or one not first."""
    conv = [{**{k: v for k, v in m.items() if k != "tools"}, "role": "system"} if m["role"] == "developer" else m
            for m in conv]
    systems = [i for i, m in enumerate(conv) if m["role"] == "system"]
    if not systems or systems == [0]:
        return conv
    merged = "\n\n".join(conv[i]["content"] for i in systems if conv[i]["content"])
    return [{"role": "system", "content": merged}, *(m for m in conv if m["role"] != "system")]


@dataclass(frozen=True, eq=False)
class ChatTokenizer:
    """One tokenizer directory, loaded: its tokenizer, chat templates and special tokens."""

    directory: str
    tokenizer: Tokenizer
    templates: Mapping[str, str]  # name -> template text; a single template is "default"
    special_tokens: Mapping[str, str]  # what the template sees as bos_token, eos_token, ...
    segments: SegmentCache = field(init=False, repr=False)  # long chats' pieces, tokenized once

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", SegmentCache(self.tokenizer))

    def template(self) -> str:
        """The template transformers picks for a request without tools: the only one, or `default`."""
        if "default" in self.templates:
            return self.templates["default"]
        if len(self.templates) == 1:
            return next(iter(self.templates.values()))
        raise TemplateRejected(f"{self.directory}: several chat templates ({', '.join(sorted(self.templates))}) "
                               f"and none named 'default'")

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The chat as the engine's template renders it (the text before tokenizing)."""
        if add_generation_prompt and continue_final_message:
            raise TemplateRejected("cannot set both `continue_final_message` and `add_generation_prompt`")
        source = self.template()
        compiled, variables = _compile(source)
        if walks_content_parts(source):
            raise NotCovered(f"{self.directory}: the chat template loops over content parts (vLLM's \"openai\" "
                             f"content format), which quilld does not render yet")
        extra = dict(chat_template_kwargs or {})
        if bad := _FORBIDDEN_KWARGS & extra.keys():
            raise TemplateRejected(f"unexpected chat template kwargs: {', '.join(sorted(bad))}")
        if bad := _UNCHECKED_KWARGS & extra.keys():
            raise NotCovered(f"requests with {', '.join(sorted(bad))} are not rendered by quilld yet")
        extra = {k: v for k, v in extra.items() if k in variables and v is not None}  # vLLM's filter
        chat = _conversation(messages, source)
        final = None
        if continue_final_message:
            final = chat[-1].get("content")
            if not isinstance(final, str) or "content" not in source:
                raise TemplateRejected("continue_final_message needs a final message with text content")
            chat[-1]["content"] = final + _CONTINUE_TAG
        context = {**self.special_tokens, **_plain(extra)}
        try:
            text = compiled.render(messages=chat, tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt, **context)
        except Exception as e:  # vLLM answers 400 with the reason for anything raised inside the template
            raise TemplateRejected(f"the chat template rejected the request: {e}") from None
        if final is not None:
            tag = _CONTINUE_TAG.strip()
            if final.strip() not in text or tag not in text:
                raise TemplateRejected("continue_final_message: the template does not render the final message")
            at = text.rindex(tag)
            text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
        return text

    def chat_token_ids(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> list[int]:
        """The chat's token ids as vLLM's chat endpoint computes them (see `render` for the options)."""
        return self.segments.ids(self.render(messages, **options))

    def prompt_token_ids(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """A completions prompt's token ids as vLLM's completions endpoint computes them."""
        return encode(self.tokenizer, prompt, add_special_tokens)


def encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """`text`'s token ids. Through `encode_batch`, which releases the GIL while Rust works, where
    `encode` holds it: a 32k-token prompt's ~30 ms in a worker thread would otherwise stop the
    event loop as long (bench/gateway_ttft_bench.py's loop check). The same ids either way."""
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


@functools.lru_cache(maxsize=64)
def _compile(source: str) -> tuple[jinja2.Template, frozenset[str]]:
    """A template compiled once per text, with the variables it reads from outside."""
    env = _environment()
    try:
        return env.from_string(source), frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
    except jinja2.TemplateSyntaxError as e:
        raise TemplateUnavailable(f"chat template does not compile: {e.message} (line {e.lineno})") from None


def _loop_source(node: jinja2.nodes.Node) -> jinja2.nodes.Node:
    """What a for loop walks, under its filters, tests and slices (`content | list`, `content[1:]`)."""
    while True:
        if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
            node = node.node
        else:
            return node


@functools.lru_cache(maxsize=64)
def walks_content_parts(source: str) -> bool:
    """Whether the template may loop over a message's content as a list of parts, which vLLM then
    hands it as a list (its "openai" content format) rather than joined text. Errs towards yes: any
    loop over something's `content`, over a variable named `content`, or over a macro's parameter."""
    tree = _environment().parse(source)
    params = {arg.name for macro in tree.find_all(jinja2.nodes.Macro) for arg in macro.args}
    for loop in tree.find_all(jinja2.nodes.For):
        it = _loop_source(loop.iter)
        if isinstance(it, jinja2.nodes.Getattr) and it.attr == "content":
            return True
        if isinstance(it, jinja2.nodes.Getitem) and isinstance(it.arg, jinja2.nodes.Const) \
                and it.arg.value == "content":
            return True
        if isinstance(it, jinja2.nodes.Name) and (it.name == "content" or it.name in params):
            return True
    return False


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise TemplateUnavailable(f"{path}: {e}") from None
    if not isinstance(data, dict):
        raise TemplateUnavailable(f"{path}: not a JSON object")
    return data


def _templates(directory: str, config: Mapping[str, Any]) -> dict[str, str]:
    """The directory's chat templates, as transformers 5 finds them (a template file wins)."""
    found: dict[str, str] = {}
    jinja_file = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            found["default"] = f.read()
    extra_dir = os.path.join(directory, "additional_chat_templates")
    if os.path.isdir(extra_dir):
        for name in sorted(os.listdir(extra_dir)):
            if name.endswith(".jinja"):
                with open(os.path.join(extra_dir, name), encoding="utf-8") as f:
                    found[name.removesuffix(".jinja")] = f.read()
    if found:
        return found
    template = config.get("chat_template")
    if isinstance(template, str):
        return {"default": template}
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template
                if isinstance(t, Mapping) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
    return {}


@functools.lru_cache(maxsize=LOADED_DIRS)
def _load(directory: str) -> ChatTokenizer:
    tok_file = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(tok_file):
        raise TemplateUnavailable(f"{directory}: no tokenizer.json (a Hugging Face tokenizer directory has one)")
    try:
        tokenizer = Tokenizer.from_file(tok_file)
    except Exception as e:  # the Rust side raises plain Exception for an invalid file
        raise TemplateUnavailable(f"{tok_file}: {e}") from None
    config = _read_json(os.path.join(directory, "tokenizer_config.json"))
    templates = _templates(directory, config)
    if not templates:
        raise TemplateUnavailable(f"{directory}: no chat template (neither chat_template.jinja nor a chat_template "
                                  f"in tokenizer_config.json): vLLM refuses chat requests for it too")
    for name, source in templates.items():  # a broken template is the engine's configuration error, found now
        try:
            _compile(source)
        except TemplateUnavailable as e:
            raise TemplateUnavailable(f"{directory}: {name} {e.message}") from None
    special = {name: text for name in SPECIAL_TOKENS if (text := _token_text(config.get(name))) is not None}
    # transformers adds a named special token that tokenizer.json lacks, so its text encodes as one id
    missing = [AddedToken(t, special=True) for t in dict.fromkeys(special.values()) if tokenizer.token_to_id(t) is None]
    if missing:
        tokenizer.add_special_tokens(missing)
    return ChatTokenizer(directory, tokenizer, templates, special)


def load(directory: str | os.PathLike[str]) -> ChatTokenizer:
    """The tokenizer directory's `ChatTokenizer`, loaded once per directory (raises `TemplateUnavailable`)."""
    return _load(os.path.realpath(os.fspath(directory)))
