"""Tag parsing shared by the tasks: tool calls and tagged answers in model output."""

from __future__ import annotations

import re


def tool_call_body(turn_text: str, open_tag: str, close_tag: str) -> str | None:
  """Text after the last `open_tag` of a turn that ends with `close_tag`; None if it does not."""
  text = turn_text.rstrip()
  if not text.endswith(close_tag):
    return None
  body = text[: -len(close_tag)]
  start = body.rfind(open_tag)
  return None if start < 0 else body[start + len(open_tag):]


def tagged_spans(text: str, open_tag: str, close_tag: str) -> list[tuple[int, str]]:
  """(start, content) of every complete open…close span, in order."""
  pattern = re.escape(open_tag) + r"(.*?)" + re.escape(close_tag)
  return [(m.start(), m.group(1)) for m in re.finditer(pattern, text, flags=re.S)]
