"""Hostile chat templates: sandbox escapes, unbounded loops and output, deep recursion, undefined
names, syntax errors and file access — a model's tokenizer_config.json is untrusted input."""

from __future__ import annotations

from hypothesis import strategies as st

from colibri_stream.devtools.fuzz.mutations import CANARY

ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ raise_exception.__globals__['__builtins__']['open']('" + CANARY + "').read() }}",
    "{{ strftime_now.__globals__ }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ self._TemplateReference__context }}",
    "{{ range.__self__ }}",
    "{% include '" + CANARY + "' %}",
    "{% import '../outside/canary' as x %}",
    "{% extends '" + CANARY + "' %}",
]
UNBOUNDED = [
    "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}{% endfor %}{% endfor %}"
    "{% endfor %}",
    "{{ 'x' * 4000000000 }}",
    "{{ 'x' * 100000 * 100000 }}",
    "{{ [1] * 1000000000 }}",
    "{{ 10 ** 10 ** 8 }}",
    "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}",
    "{{ messages[0]['content'] | wordwrap(1) * 100000000 }}",
    "{{ '%0999999999d' % 1 }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{{ range(10**9) | list }}",
    "{{ lipsum(1000000000) }}",
]
BROKEN = [
    "{% for %}",
    "{{ foo.bar.baz }}",
    "{{ messages[99]['content'] }}",
    "{{ raise_exception('fuzz') }}",
    "{{ messages[0]['content'] | nosuchfilter }}",
    "{{ strftime_now('%Q' * 1000) }}",
    "{% if %}",
    "{{ 1 / 0 }}",
    "{{ messages | tojson(indent=10**9) }}",
    "\u0000{{ bos_token }}",
    "{{ bos_token }}" * 10000,
]
TEMPLATES = ESCAPES + UNBOUNDED + BROKEN


def hostile_template() -> st.SearchStrategy[str]:
    """One hostile snippet, alone or around the real template's parts."""
    snippet = st.sampled_from(TEMPLATES)
    wrapped = st.builds(
        lambda s: "{% for message in messages %}" + s + "{{ message['content'] }}{% endfor %}assistant:", snippet
    )
    return st.one_of(snippet, wrapped, st.text(max_size=40))
