"""Search: a BM25 retriever over a local corpus, its HTTP service, the prompt format and rewards.

Format (Search-R1 style): the model reasons, writes a query inside
<search>...</search> (generation stops there), the retrieved passages come back
inside <information>...</information> (mask = 0 tokens), and the final answer is
inside <answer>...</answer>. Rewards: exact match and token F1 after SQuAD's
normalisation (lower case, no punctuation, no articles, single spaces), the
best over the acceptable answers.
"""

from __future__ import annotations

import collections
import json
import os
import re
import string
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import bm25s
import numpy as np

from copc_jax.envs import tags

SEARCH_OPEN, SEARCH_CLOSE = "<search>", "</search>"
INFO_OPEN, INFO_CLOSE = "<information>", "</information>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"

SYSTEM_PROMPT = (
    "Answer the question. To look something up, write a query between <search> and </search>; "
    "the results come back between <information> and </information>. Give the final answer "
    "between <answer> and </answer>.")


def format_prompt(question: str) -> str:
  return f"{SYSTEM_PROMPT}\nQuestion: {question}\n"


# --- rewards ------------------------------------------------------------------

def normalize_answer(text: str) -> str:
  """SQuAD normalisation: lower case, drop punctuation and articles, collapse whitespace."""
  text = text.lower()
  text = "".join(ch for ch in text if ch not in set(string.punctuation))
  text = re.sub(r"\b(a|an|the)\b", " ", text)
  return " ".join(text.split())


def exact_match(prediction: str, answers: str | list[str]) -> float:
  answers = [answers] if isinstance(answers, str) else answers
  return float(any(normalize_answer(prediction) == normalize_answer(a) for a in answers))


def f1_score(prediction: str, answers: str | list[str]) -> float:
  answers = [answers] if isinstance(answers, str) else answers
  pred_tokens = normalize_answer(prediction).split()
  best = 0.0
  for answer in answers:
    gold_tokens = normalize_answer(answer).split()
    common = collections.Counter(pred_tokens) & collections.Counter(gold_tokens)
    overlap = sum(common.values())
    if overlap == 0:
      continue
    precision, recall = overlap / len(pred_tokens), overlap / len(gold_tokens)
    best = max(best, 2 * precision * recall / (precision + recall))
  return best


def extract_answer(response: str) -> str | None:
  """The last complete <answer>…</answer>; None if there is none."""
  spans = tags.tagged_spans(response, ANSWER_OPEN, ANSWER_CLOSE)
  return spans[-1][1].strip() if spans else None


def extract_query(turn_text: str) -> str | None:
  """The query of a search call: after the last <search> of a turn that ends with </search>."""
  body = tags.tool_call_body(turn_text, SEARCH_OPEN, SEARCH_CLOSE)
  return (body or "").strip() or None


def search_reward(response: str, answers: str | list[str], *, metric: str = "em") -> float:
  if metric not in ("em", "f1"):
    raise ValueError(f"metric must be 'em' or 'f1'; got {metric!r}")
  answer = extract_answer(response)
  if answer is None:
    return 0.0
  return exact_match(answer, answers) if metric == "em" else f1_score(answer, answers)


# --- retriever ----------------------------------------------------------------

class Retriever:
  """BM25 (bm25s) over passages {"id", "contents"}; saved and loaded as a directory."""

  def __init__(self, passages: list[dict], index: bm25s.BM25 | None = None):
    if not passages:
      raise ValueError("the corpus is empty")
    self.passages = passages
    if index is None:
      index = bm25s.BM25()
      index.index(bm25s.tokenize([p["contents"] for p in passages], stopwords="en", show_progress=False),
                  show_progress=False)
    self.index = index

  @classmethod
  def from_jsonl(cls, path: str, text_field: str = "contents") -> Retriever:
    if not os.path.exists(path):
      raise FileNotFoundError(f"corpus not found: {path}")
    passages = []
    with open(path) as f:
      for i, line in enumerate(f):
        if line.strip():
          row = json.loads(line)
          if text_field not in row:
            raise ValueError(f"{path} line {i}: no field {text_field!r}; the row has {sorted(row)}")
          passages.append({"id": str(row.get("id", i)), "contents": row[text_field]})
    return cls(passages)

  def save(self, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    self.index.save(os.path.join(directory, "bm25"))
    with open(os.path.join(directory, "passages.jsonl"), "w") as f:
      for p in self.passages:
        f.write(json.dumps(p) + "\n")

  @classmethod
  def load(cls, directory: str) -> Retriever:
    with open(os.path.join(directory, "passages.jsonl")) as f:
      passages = [json.loads(line) for line in f if line.strip()]
    return cls(passages, bm25s.BM25.load(os.path.join(directory, "bm25")))

  def search(self, queries: list[str], topk: int = 3) -> list[list[dict]]:
    if topk < 1:
      raise ValueError(f"topk must be >= 1; got {topk}")
    topk = min(topk, len(self.passages))
    tokens = bm25s.tokenize(list(queries), stopwords="en", show_progress=False)
    ids, scores = self.index.retrieve(tokens, k=topk, show_progress=False)
    return [[{**self.passages[int(i)], "score": float(s)} for i, s in zip(row_ids, row_scores, strict=True)
             if np.isfinite(s)] for row_ids, row_scores in zip(ids, scores, strict=True)]


def format_information(results: list[dict]) -> str:
  body = "\n".join(f"Doc {i + 1}: {r['contents']}" for i, r in enumerate(results))
  return f"\n{INFO_OPEN}\n{body}\n{INFO_CLOSE}\n"


class SearchTool:
  """The tool of a search turn: query → formatted passages (in-process or over HTTP)."""

  def __init__(self, retriever: Retriever | None = None, url: str | None = None, topk: int = 3):
    if (retriever is None) == (url is None):
      raise ValueError("give either a retriever or the url of a retrieval service")
    self.retriever, self.url, self.topk = retriever, url, topk

  def __call__(self, turn_text: str) -> str:
    query = extract_query(turn_text)
    if query is None:
      return f"\n{INFO_OPEN}\nno query found between {SEARCH_OPEN} and {SEARCH_CLOSE}\n{INFO_CLOSE}\n"
    if self.retriever is not None:
      results = self.retriever.search([query], self.topk)[0]
    else:
      results = retrieve_http(self.url, [query], self.topk)[0]
    return format_information(results)


# --- HTTP service (Search-R1's retriever API: POST /retrieve) -------------------

def retrieve_http(url: str, queries: list[str], topk: int = 3, timeout_s: float = 30.0) -> list[list[dict]]:
  import urllib.request

  request = urllib.request.Request(f"{url.rstrip('/')}/retrieve", method="POST",
                                   data=json.dumps({"queries": queries, "topk": topk}).encode(),
                                   headers={"Content-Type": "application/json"})
  with urllib.request.urlopen(request, timeout=timeout_s) as response:
    return json.loads(response.read())["result"]


def make_http_server(retriever: Retriever, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
  """POST /retrieve {"queries": [...], "topk": k} → {"result": [[passage, ...], ...]}."""
  lock = threading.Lock()

  class Handler(BaseHTTPRequestHandler):
    def _reply(self, code: int, payload: dict):
      body = json.dumps(payload).encode()
      self.send_response(code)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    def do_POST(self):  # noqa: N802 - http.server API
      if self.path != "/retrieve":
        return self._reply(404, {"error": f"unknown path {self.path}; use POST /retrieve"})
      try:
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        queries, topk = request["queries"], int(request.get("topk", 3))
        if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
          raise ValueError("queries must be a list of strings")
        with lock:
          result = retriever.search(queries, topk)
      except (KeyError, ValueError, TypeError, json.JSONDecodeError) as err:
        return self._reply(400, {"error": f"bad request: {err}"})
      return self._reply(200, {"result": result})

    def log_message(self, *args):
      pass

  return ThreadingHTTPServer((host, port), Handler)


def main():
  import argparse

  parser = argparse.ArgumentParser(description="Serve a BM25 index over HTTP (POST /retrieve).")
  parser.add_argument("--corpus", help="JSONL passages with a 'contents' field (builds the index)")
  parser.add_argument("--index", help="a directory written by Retriever.save")
  parser.add_argument("--host", default="127.0.0.1")
  parser.add_argument("--port", type=int, default=8000)
  args = parser.parse_args()
  if bool(args.corpus) == bool(args.index):
    parser.error("give exactly one of --corpus and --index")
  retriever = Retriever.from_jsonl(args.corpus) if args.corpus else Retriever.load(args.index)
  server = make_http_server(retriever, args.host, args.port)
  print(f"retrieval service on http://{args.host}:{server.server_address[1]}/retrieve", flush=True)
  server.serve_forever()


if __name__ == "__main__":
  main()
