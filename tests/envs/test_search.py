import json
import threading

import pytest

from copc_jax.envs import search

PASSAGES = [{"id": "a", "contents": "Zorvak Tellim was born in Quenport."},
            {"id": "b", "contents": "Miravex Labs was founded by Zorvak Tellim."},
            {"id": "c", "contents": "The Pelo river flows through Danmark."}]


@pytest.mark.parametrize("prediction, answers, em, f1", [
    ("The Quenport", "quenport", 1.0, 1.0),
    ("quenport!", ["Paris", "Quenport"], 1.0, 1.0),
    ("north Quenport city", "Quenport", 0.0, 0.5),
    ("", "Quenport", 0.0, 0.0),
    ("an apple", "apple", 1.0, 1.0),
])
def test_exact_match_and_f1_with_squad_normalisation(prediction, answers, em, f1):
  assert search.exact_match(prediction, answers) == em
  assert search.f1_score(prediction, answers) == pytest.approx(f1)


def test_rewards_of_malformed_and_empty_outputs():
  assert search.search_reward("<answer>Quenport</answer>", "Quenport") == 1.0
  assert search.search_reward("<answer>Quenport", "Quenport") == 0.0
  assert search.search_reward("", "Quenport") == 0.0
  assert search.search_reward("<answer>a</answer> then <answer>Quenport</answer>", "Quenport") == 1.0
  assert search.extract_query("think <search>who founded Miravex</search>") == "who founded Miravex"
  assert search.extract_query("<search>unterminated") is None
  assert search.extract_query("<search> </search>") is None


def test_retriever_topk_save_load_and_tool(tmp_path):
  corpus = tmp_path / "corpus.jsonl"
  corpus.write_text("".join(json.dumps(p) + "\n" for p in PASSAGES))
  retriever = search.Retriever.from_jsonl(str(corpus))
  assert retriever.search(["who founded Miravex Labs"], topk=1)[0][0]["id"] == "b"
  retriever.save(str(tmp_path / "index"))
  loaded = search.Retriever.load(str(tmp_path / "index"))
  assert [r["id"] for r in loaded.search(["Tellim born"], 2)[0]] == \
      [r["id"] for r in retriever.search(["Tellim born"], 2)[0]]
  info = search.SearchTool(retriever=loaded, topk=1)("<search>Pelo river</search>")
  assert info.startswith("\n<information>") and "Danmark" in info
  with pytest.raises(FileNotFoundError, match="corpus not found"):
    search.Retriever.from_jsonl(str(tmp_path / "missing.jsonl"))


def test_http_service_like_search_r1():
  server = search.make_http_server(search.Retriever(PASSAGES))
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  url = f"http://127.0.0.1:{server.server_address[1]}"
  try:
    results = search.retrieve_http(url, ["Miravex founded", "Pelo river"], topk=1)
    assert [r[0]["id"] for r in results] == ["b", "c"]
    assert "Quenport" in search.SearchTool(url=url)("<search>Zorvak Tellim born</search>")
    import urllib.error
    with pytest.raises(urllib.error.HTTPError) as err:
      search.retrieve_http(url, "not a list")
    assert err.value.code == 400
  finally:
    server.shutdown()
