"""``ChatTemplate``: renders a model's Jinja chat template exactly as HF transformers does.

The environment is sandboxed (``ImmutableSandboxedEnvironment``: templates come from model repos
and are untrusted code) and has the globals and filters of ``apply_chat_template``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
import msgspec
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dynamo.runtime.errors import InvalidArgument

Message = Mapping[str, Any] | msgspec.Struct
"""A chat message: a JSON-like dict, or a msgspec Struct (converted with ``to_builtins``)."""

DEFAULT_TEMPLATE_NAME = "default"
TOOL_USE_TEMPLATE_NAME = "tool_use"
# Names a message's reasoning goes by; templates read the first (as transformers aliases them).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markers): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore-prefixed attributes (as transformers does)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's Namespace signature
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


class _TemplateDict:
    """``dict(...)`` for templates without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _check_namespace_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot store underscore-prefixed attributes on a namespace: {name!r}"
        )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes; transformers replaces it with plain json.dumps.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


class ChatTemplate:
    """A model's chat template(s), compiled once; ``render`` is safe to call concurrently.

    ``source`` is one template, or named templates (``default``, ``tool_use``, ...) as models with
    several templates ship them. ``special_tokens`` (``bos_token``, ``eos_token``, ...) are passed
    to every render, as transformers passes ``special_tokens_map``; render kwargs override them.
    A template that does not compile raises ValueError here (a model problem, not a request's).
    """

    def __init__(
        self, source: str | Mapping[str, str], special_tokens: Mapping[str, str] | None = None
    ) -> None:
        sources = {DEFAULT_TEMPLATE_NAME: source} if isinstance(source, str) else dict(source)
        if not sources:
            raise ValueError("no chat template given")
        env = _make_environment()
        self._sources = sources
        self._compiled: dict[str, jinja2.Template] = {}
        for name, text in sources.items():
            try:
                self._compiled[name] = env.from_string(text)
            except jinja2.exceptions.TemplateError as exc:
                raise ValueError(f"chat template {name!r} does not compile: {exc}") from exc
        self._special_tokens = dict(special_tokens or {})
        # The templates' globals as one plain dict: a template from ``from_string`` has no
        # globals of its own, only the environment's (set above, never changed after), which
        # jinja2 would read through a ``ChainMap`` twice a render (see ``_render``).
        self._globals = dict(env.globals)

    @property
    def names(self) -> list[str]:
        """Names of the templates (``["default"]`` for a single template)."""
        return list(self._sources)

    def source(self, name: str = DEFAULT_TEMPLATE_NAME) -> str:
        return self._sources[name]

    def render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        template_name: str | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for ``messages`` (JSON-like dicts; content a string or a list of parts).

        Same semantics as ``tokenizer.apply_chat_template(..., tokenize=False)``: keys whose value
        is None are dropped from messages, reasoning fields are aliased, extra ``kwargs`` (e.g.
        ``enable_thinking``) are template variables. ``continue_final_message`` leaves the last
        message open for the model to continue. Any failure caused by the input (a
        ``raise_exception`` in the template, a missing field, a wrong type) raises
        :class:`InvalidArgument`.
        """
        if not messages:
            raise InvalidArgument("messages must contain at least one message")
        if continue_final_message and add_generation_prompt:
            raise InvalidArgument(
                "continue_final_message and add_generation_prompt cannot both be set"
            )
        template = self._select(template_name, tools)
        chat = [_normalize_message(message) for message in messages]
        final_text = _tag_final_message(chat) if continue_final_message else None
        variables = {
            **self._special_tokens,
            **kwargs,
            "messages": chat,
            "tools": tools,
            "documents": documents,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            rendered = _render(template, self._globals, variables)
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidArgument(f"chat template error: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise InvalidArgument(f"chat template error: {type(exc).__name__}: {exc}") from exc
        if final_text is not None:
            rendered = _cut_after_final_message(rendered, final_text)
        return rendered

    def _select(
        self, template_name: str | None, tools: Sequence[Mapping[str, Any]] | None
    ) -> jinja2.Template:
        if template_name is not None:
            if template_name not in self._compiled:
                raise InvalidArgument(f"unknown chat template {template_name!r}")
            return self._compiled[template_name]
        if tools is not None and TOOL_USE_TEMPLATE_NAME in self._compiled:
            return self._compiled[TOOL_USE_TEMPLATE_NAME]
        if DEFAULT_TEMPLATE_NAME in self._compiled:
            return self._compiled[DEFAULT_TEMPLATE_NAME]
        if len(self._compiled) == 1:
            return next(iter(self._compiled.values()))
        raise InvalidArgument(
            f"the model has several chat templates and no default: {sorted(self._compiled)}"
        )


def _render(template: jinja2.Template, globals_: dict[str, Any], variables: dict[str, Any]) -> str:
    """``template.render(**variables)`` where ``globals_`` are the template's globals, leaving no
    reference cycle behind. Same result and exceptions as ``Template.render``.

    A template's macros (most chat templates define some: content renderers, tool formatters)
    are closures over the render's context, and the context's variables hold the macros: every
    render left a cycle of ~20 objects (context, macro, closure cells, dicts, sets) that only the
    garbage collector freed. At c=64 that garbage ran the frontend's young collections, 2-8 ms
    of the event loop's thread each, ~4 % of it. Emptying the context's variables once the
    render is done breaks the cycle, so reference counting frees the render's objects at once.
    The context is built here from a plain dict of the globals (``Template.new_context`` copies
    them out of a ``ChainMap`` and then iterates it again, in Python: ~40 % of a short render)."""
    env = template.environment
    context = env.context_class(
        env, {**globals_, **variables}, template.name, template.blocks, globals=globals_
    )
    try:
        return env.concat(template.root_render_func(context))  # type: ignore[attr-defined,no-any-return]
    except Exception:
        env.handle_exception()
    finally:
        context.vars.clear()


def _normalize_message(message: Message) -> dict[str, Any]:
    if isinstance(message, msgspec.Struct):
        message = msgspec.to_builtins(message)
    if not isinstance(message, Mapping):
        raise InvalidArgument(f"a chat message must be an object, got {type(message).__name__}")
    chat_message = {key: value for key, value in message.items() if value is not None}
    reasoning = next(
        (chat_message[key] for key in _REASONING_FIELDS if chat_message.get(key) is not None), None
    )
    if reasoning is not None:
        chat_message = {"thinking": reasoning, **chat_message, "reasoning_content": reasoning}
    return chat_message


def _tag_final_message(chat: list[dict[str, Any]]) -> str:
    """Append a marker to the final message's (last text part's) content; return that text."""
    final = chat[-1]
    content = final.get("content")
    if isinstance(content, str):
        final["content"] = content + _CONTINUE_TAG
        return content
    if isinstance(content, list):
        parts = [dict(part) if isinstance(part, Mapping) else part for part in content]
        for part in reversed(parts):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                text: str = part["text"]
                part["text"] = text + _CONTINUE_TAG
                final["content"] = parts
                return text
    raise InvalidArgument("continue_final_message is set but the final message has no text")


def _cut_after_final_message(rendered: str, final_text: str) -> str:
    marker = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or marker not in rendered:
        raise InvalidArgument(
            "continue_final_message is set but the chat template drops the final message"
        )
    tag_at = rendered.rindex(marker)
    if rendered[tag_at : tag_at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:tag_at]
    return rendered[:tag_at].rstrip()  # the template trimmed trailing space after the content
