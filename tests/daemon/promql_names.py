"""The metric and label names a PromQL expression reads, by a small tokenizer.

Enough PromQL for dashboards: selectors with label matchers, range selectors, functions,
aggregations with `by`/`without`, vector matching with `on`/`ignoring`/`group_left`/
`group_right`, binary operators and Grafana's `$variables`. Not a full parser (no PromQL
parser exists for Python that is kept up), but what it misses it reports as a name, so a
mistake shows up as a failing test rather than a silent pass.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Tokens, in order of precedence: strings, durations and variables are skipped whole.
_TOKEN = re.compile(
    r"""
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<range>\[[^\]]*\])
  | (?P<variable>\$\{?\w+\}?)
  | (?P<duration>(?:\d+(?:ms|[smhdwy]))+\b)
  | (?P<number>\d+(?:\.\d+)?(?:e[+-]?\d+)?)
  | (?P<name>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<matcher>=~|!~|!=|==|=)
  | (?P<punct>[{}(),])
  | (?P<operator>[-+*/%^<>]=?)
  | (?P<space>\s+)
    """,
    re.VERBOSE,
)
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan"})
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})


@dataclass(slots=True)
class Names:
    metrics: set[str] = field(default_factory=set)
    labels: set[str] = field(default_factory=set)


def _tokens(expr: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    position = 0
    while position < len(expr):
        match = _TOKEN.match(expr, position)
        if match is None:
            raise ValueError(f"cannot read {expr[position:]!r} in {expr!r}")
        kind = match.lastgroup
        assert kind is not None
        if kind != "space":
            out.append((kind, match.group()))
        position = match.end()
    return out


def names(expr: str) -> Names:
    """Metric names (selectors) and label names (matchers, grouping lists) in `expr`."""
    found = Names()
    tokens = _tokens(expr)
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if text == "{":  # label matchers: `name op "value"`, comma separated
            i += 1
            while tokens[i][1] != "}":
                if tokens[i][0] == "name" and tokens[i + 1][0] == "matcher":
                    found.labels.add(tokens[i][1])
                i += 1
        elif kind == "name" and text in GROUPING:
            if following == "(":  # a label list; group_left may have none
                i += 2
                while tokens[i][1] != ")":
                    if tokens[i][0] == "name":
                        found.labels.add(tokens[i][1])
                    i += 1
        elif kind == "name" and (following == "(" or following in GROUPING):
            pass  # a function, or an aggregation (`sum by (l) (x)`)
        elif kind == "name" and text.lower() not in KEYWORDS:
            found.metrics.add(text)
        i += 1
    return found


_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.*),\s*(?P<label>\w+)\)$")


def variable_names(query: str) -> Names:
    """The names a Grafana `label_values(selector, label)` query reads."""
    match = _LABEL_VALUES.match(query.strip())
    if match is None:
        raise ValueError(f"not a label_values query: {query!r}")
    found = names(match["selector"])
    found.labels.add(match["label"])
    return found
