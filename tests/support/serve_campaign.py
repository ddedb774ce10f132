"""The server-level fault campaign and the soak: requests of `serve_requests` sent to `vllm serve`.

- `run_load` sends requests concurrently (16 in flight by default) with `httpx`, streams read to the
  end or closed after a few events (the client disconnects), and records per request the HTTP
  status, any error event inside a stream, the texts and token ids returned, and whether the
  server still answers `/health` once the request is done.
- `compare` puts the two arms side by side (vLLM with the plugin, vLLM without it): engine deaths,
  5xx with the plugin where vLLM answers 2xx or 4xx, requests one arm accepts and the other refuses
  (explained by the request's `explained`, or not), token ids outside the vocabulary.
- `replay_alone` sends the seeded requests again one at a time and compares their texts with the
  same requests under load.
- `soak` keeps a mixed load of the generator's requests for a while, samples the server's resident
  memory and the plugin's structure sizes (the `ts_state_probe` test plugin) every `interval`
  seconds, then sends one small request and reads the sizes again: only that request is held.
"""

from __future__ import annotations

import itertools
import json
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import httpx

from tests.support.serve_requests import CampaignRequest, Vocabulary, campaign_requests, draw
from tests.support.vllm_server import Server

SERVE = ["--max-num-seqs", "16", "--max-logprobs", "20"]
MODELS = {"tiny": 256, "smollm2": 1024}  # served name -> max_model_len
PROBE_DIR = Path(__file__).resolve().parent / "vllm_probe"
PROBE_PLUGIN = "ts_state_probe"
# the per-request structures of the plugin the probe reports (`held_ids` aside)
STRUCTURES = ("seeds", "held", "occupied", "seed_slots")


@dataclass
class Outcome:
    """What one request got back."""

    index: int
    kind: str
    status: int  # the HTTP status; 0 when the connection failed
    alive: bool  # the server answered /health once the request was done
    texts: list[str] = field(default_factory=list)  # by choice index
    token_ids: list[list[int]] = field(default_factory=list)  # the sampled ids, by choice index
    named_ids: list[int] = field(default_factory=list)  # the ids its logprobs name
    stream_error: str | None = None  # an error event inside a 200 stream, or a 200 body that is not JSON
    cancelled: bool = False
    detail: str = ""  # the start of a refused request's body
    seconds: float = 0.0

    @property
    def status_class(self) -> str:
        """'2xx', '4xx', '5xx' (a 200 stream with a server error event counts as 5xx) or 'no answer'."""
        if self.status == 0:
            return "no answer"
        if self.stream_error is not None and "500" in self.stream_error:
            return "5xx"
        return f"{self.status // 100}xx"


# ---------------------------------------------------------------- one request
def _named_ids(value: Any, out: list[int]) -> None:
    """The ids a response names as `token_id:N` (logprobs with `return_tokens_as_token_ids`), anywhere."""
    if isinstance(value, dict):
        for key, item in value.items():
            _named_ids(key, out)
            _named_ids(item, out)
    elif isinstance(value, list):
        for item in value:
            _named_ids(item, out)
    elif isinstance(value, str) and value.startswith("token_id:"):
        out.append(int(value.split(":", 1)[1]))


def _choice_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    part = choice.get("delta") or choice.get("message") or {}
    return part.get("content") or ""


def _collect(event: dict[str, Any], texts: dict[int, str], sampled: dict[int, list[int]], named: list[int]) -> None:
    """One answer or stream event: each choice's text and sampled ids (`token_ids`), and named ids."""
    for choice in event.get("choices") or ():
        index = int(choice.get("index", 0))
        texts[index] = texts.get(index, "") + _choice_text(choice)
        sampled.setdefault(index, []).extend(int(t) for t in choice.get("token_ids") or ())
    _named_ids(event, named)


def _read_stream(response: httpx.Response, request: CampaignRequest, outcome: Outcome,
                 texts: dict[int, str], sampled: dict[int, list[int]]) -> None:
    events = 0
    for line in response.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        try:
            event = json.loads(line[len("data: "):])
        except ValueError:
            event = {"error": f"an event that is not JSON: {line[:200]!r}"}
        if "error" in event:
            outcome.stream_error = json.dumps(event["error"])[:300]
        _collect(event, texts, sampled, outcome.named_ids)
        events += 1
        if request.cancel_after is not None and events >= request.cancel_after:
            outcome.cancelled = True  # leaving the `with` closes the connection mid-stream
            return


def _json(response: httpx.Response) -> dict[str, Any]:
    """A 200 answer's JSON; a body that is not JSON becomes an error event (counted as a stream error)."""
    try:
        return response.json()
    except ValueError:
        return {"error": f"a 200 body that is not JSON: {response.text[:200]!r}"}


def send(client: httpx.Client, url: str, request: CampaignRequest, alive: Callable[[], bool]) -> Outcome:
    """Send one request to the server at `url`; `alive` is asked once the answer is read."""
    outcome = Outcome(request.index, request.kind, 0, True)
    texts: dict[int, str] = {}
    sampled: dict[int, list[int]] = {}
    start = time.monotonic()
    try:
        if request.body.get("stream") is True:
            with client.stream("POST", f"{url}/v1/{request.endpoint}", json=request.body) as response:
                outcome.status = response.status_code
                if response.status_code == 200:
                    _read_stream(response, request, outcome, texts, sampled)
                else:
                    outcome.detail = response.read().decode(errors="replace")[:300]
        else:
            response = client.post(f"{url}/v1/{request.endpoint}", json=request.body)
            outcome.status = response.status_code
            if response.status_code == 200:
                body = _json(response)
                if "error" in body:
                    outcome.stream_error = json.dumps(body["error"])[:300]
                _collect(body, texts, sampled, outcome.named_ids)
            else:
                outcome.detail = response.text[:300]
    except httpx.HTTPError as error:
        outcome.detail = f"{type(error).__name__}: {error}"[:300]
    outcome.seconds = round(time.monotonic() - start, 3)
    outcome.texts = [texts[i] for i in sorted(texts)]
    outcome.token_ids = [sampled[i] for i in sorted(sampled)]
    outcome.alive = alive()
    return outcome


def client(concurrency: int) -> httpx.Client:
    """An HTTP client for `concurrency` requests in flight (a generous timeout: a CPU engine is slow)."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    return httpx.Client(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits)


def run_load(url: str, requests: Sequence[CampaignRequest], alive: Callable[[], bool], *,
             concurrency: int = 16) -> list[Outcome]:
    """Send every request, `concurrency` in flight; the outcomes in the order of `requests`."""
    with client(concurrency) as http, ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda r: send(http, url, r, alive), requests))


# ---------------------------------------------------------------- the comparison
def invalid_ids(outcomes: Sequence[Outcome], vocab_size: int) -> int:
    """How many returned token ids are outside [0, vocab_size)."""
    return sum(not 0 <= t < vocab_size for o in outcomes for t in itertools.chain(o.named_ids, *o.token_ids))


def outside_allowed(requests: Sequence[CampaignRequest], outcomes: Sequence[Outcome]) -> list[int]:
    """The answered requests with `allowed_token_ids` that sampled an id outside them."""
    out = []
    for request, outcome in zip(requests, outcomes):
        allowed = request.body.get("allowed_token_ids")
        if outcome.status == 200 and isinstance(allowed, list) and allowed:
            if any(t not in allowed for t in itertools.chain(*outcome.token_ids)):
                out.append(request.index)
    return out


def replay_alone(url: str, requests: Sequence[CampaignRequest], under_load: Sequence[Outcome],
                 alive: Callable[[], bool]) -> dict[str, Any]:
    """Send each seeded request that was answered in full under load again, alone: same texts and ids?"""
    done = {o.index: o for o in under_load}
    chosen = [r for r in requests if r.replay and done[r.index].status == 200
              and done[r.index].stream_error is None and not done[r.index].cancelled]
    differ: list[int] = []
    with client(1) as http:
        for request in chosen:
            again = send(http, url, request, alive)
            first = done[request.index]
            if (again.status, again.texts, again.token_ids) != (200, first.texts, first.token_ids):
                differ.append(request.index)
    return {"replayed": len(chosen), "identical": len(chosen) - len(differ), "differ": differ}


def compare(requests: Sequence[CampaignRequest], plugin: Sequence[Outcome], vllm: Sequence[Outcome],
            vocab_size: int) -> dict[str, Any]:
    """The campaign's findings, request by request, between the arm with the plugin and vLLM's own."""
    plugin_5xx, explained, unexplained = [], [], []
    for request, ours, theirs in zip(requests, plugin, vllm):
        if ours.status_class in ("5xx", "no answer") and theirs.status_class in ("2xx", "4xx"):
            plugin_5xx.append(request.index)
        elif {ours.status_class, theirs.status_class} == {"2xx", "4xx"}:
            row = {"index": request.index, "kind": request.kind, "plugin": ours.status, "vllm": theirs.status,
                   "why": request.explained}
            (explained if request.explained else unexplained).append(row)
    return {
        "deaths": {"plugin": sum(not o.alive for o in plugin), "vllm": sum(not o.alive for o in vllm)},
        "plugin_5xx_where_vllm_is_not": plugin_5xx,
        "mismatched_explained": explained,
        "mismatched_unexplained": unexplained,
        "invalid_ids": {"plugin": invalid_ids(plugin, vocab_size), "vllm": invalid_ids(vllm, vocab_size)},
        "outside_allowed": {"plugin": outside_allowed(requests, plugin), "vllm": outside_allowed(requests, vllm)},
        "stream_errors": {"plugin": sum(o.stream_error is not None for o in plugin),
                          "vllm": sum(o.stream_error is not None for o in vllm)},
    }


def by_kind(requests: Sequence[CampaignRequest], arms: dict[str, Sequence[Outcome]]) -> dict[str, Any]:
    """Per kind: requests sent, and per arm the count of each status class."""
    table: dict[str, Any] = {}
    for i, request in enumerate(requests):
        row = table.setdefault(request.kind, {"sent": 0, **{arm: Counter() for arm in arms}})
        row["sent"] += 1
        for arm, outcomes in arms.items():
            row[arm][outcomes[i].status_class] += 1
    return {kind: {k: dict(v) if isinstance(v, Counter) else v for k, v in row.items()}
            for kind, row in sorted(table.items())}


def greedy_check(url: str, model: str) -> bool:
    """The engine still serves: one greedy completion comes back with its tokens."""
    body = {"model": model, "prompt": [1, 5, 6, 7], "max_tokens": 4, "temperature": 0.0, "return_token_ids": True}
    with client(1) as http:
        response = http.post(f"{url}/v1/completions", json=body)
    return response.status_code == 200 and len(response.json()["choices"][0].get("token_ids") or []) >= 1


def outcomes_json(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    return [asdict(o) for o in outcomes]


# ---------------------------------------------------------------- the soak
def endless(seed: int, vocab: Vocabulary) -> Iterator[CampaignRequest]:
    """The generator's requests, one after the other, forever (thread-safe through `next` under a lock)."""
    rng = random.Random(seed)
    for index in itertools.count():
        yield draw(index, rng, vocab)


def growth_per_request(samples: Sequence[dict[str, Any]], key: str) -> float | None:
    """Growth per request (bytes) of `key` (a sample's field, or one of its probe sizes) over the
    second half of the load's samples (the first half warms vLLM's and the allocator's caches): the
    least-squares slope against the requests answered, so that one burst of the allocator does not
    decide it; None with fewer than 3 samples holding it. The samples after the load are left out."""
    def value(sample: dict[str, Any]) -> Any:
        return sample.get(key, (sample.get("sizes") or {}).get(key))

    points = [(s["requests"], value(s)) for s in samples[len(samples) // 2:] if value(s) is not None]
    if len(points) < 3:
        return None
    mean_n = sum(n for n, _ in points) / len(points)
    mean_v = sum(v for _, v in points) / len(points)
    spread = sum((n - mean_n) ** 2 for n, _ in points)
    return sum((n - mean_n) * (v - mean_v) for n, v in points) / max(spread, 1.0)


def read_probe(path: Path) -> dict[str, Any] | None:
    """The last structure sizes the probe wrote (None before the first step)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def idle_check(url: str, model: str, probe: Path) -> dict[str, Any]:
    """After the load: one small greedy request, then the structure sizes (only it is held)."""
    time.sleep(2.0)
    body = {"model": model, "prompt": [1, 5, 6, 7], "max_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    with client(1) as http:
        response = http.post(f"{url}/v1/completions", json=body)
    sizes = read_probe(probe) or {}
    rid = response.json().get("id", "") if response.status_code == 200 else ""
    return {"status": response.status_code, "request_id": rid, "sizes": sizes,
            "only_it_held": len(sizes.get("held_ids", ())) == 1 and rid != ""
            and all(sizes.get(name) == 1 for name in STRUCTURES)}


ERRORS_KEPT = 100


def server_error(request: CampaignRequest, outcome: Outcome) -> dict[str, Any]:
    """What the soak keeps of a request answered with a 5xx (or not at all): the request and the answer."""
    return {"kind": request.kind, "endpoint": request.endpoint, "body": request.body, "status": outcome.status,
            "detail": outcome.detail, "stream_error": outcome.stream_error, "seconds": outcome.seconds}


def soak(url: str, vocab: Vocabulary, *, seconds: float, interval: float, seed: int, probe: Path,
         rss: Callable[[str], dict[str, int]], alive: Callable[[], bool], concurrency: int = 16) -> dict[str, Any]:
    """Mixed load for `seconds`; resident memory (`rss(field)`: bytes by process, `VmRSS` and
    `RssAnon`) and structure sizes (the probe's, with the engine's heap in use) every `interval` s;
    then the idle check."""
    requests = endless(seed, vocab)
    lock = threading.Lock()
    statuses: Counter = Counter()
    kinds: dict[str, Counter] = {}
    deaths = [0]
    errors: list[dict[str, Any]] = []  # the first `ERRORS_KEPT` 5xx or unanswered requests, in full
    deadline = time.monotonic() + seconds

    def worker(http: httpx.Client) -> None:
        while time.monotonic() < deadline:
            with lock:
                request = next(requests)
            outcome = send(http, url, request, alive)
            with lock:
                statuses[outcome.status_class] += 1
                kinds.setdefault(request.kind, Counter())[outcome.status_class] += 1
                deaths[0] += not outcome.alive
                if outcome.status_class in ("5xx", "no answer") and len(errors) < ERRORS_KEPT:
                    errors.append(server_error(request, outcome))

    samples: list[dict[str, Any]] = []
    start = time.monotonic()

    def sample(sizes: dict[str, Any] | None) -> None:
        processes, anonymous = rss("VmRSS"), rss("RssAnon")
        with lock:
            done = sum(statuses.values())
        samples.append({"t": round(time.monotonic() - start, 1), "requests": done, "rss": sum(processes.values()),
                        "anon": sum(anonymous.values()), "processes": processes, "anonymous": anonymous,
                        "sizes": sizes})

    with client(concurrency) as http, ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(worker, http) for _ in range(concurrency)]
        while time.monotonic() < deadline:
            sample(read_probe(probe))
            time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
        for future in futures:
            future.result()
    sample(read_probe(probe))
    idle = idle_check(url, vocab.model, probe)
    sample(idle["sizes"])
    return {"seconds": seconds, "interval": interval, "requests": sum(statuses.values()),
            "statuses": dict(statuses),
            "kinds": {kind: dict(counts) for kind, counts in sorted(kinds.items())}, "deaths": deaths[0],
            "samples": samples, "server_errors": errors,
            "idle": idle, "alive_after": alive(),
            "rss_growth_per_request": growth_per_request(samples[:-2], "rss"),
            "heap_growth_per_request": growth_per_request(samples[:-2], "heap_in_use")}


# ---------------------------------------------------------------- both arms, on servers of their own


def serve(path: Path, vocab: Vocabulary, log: Path, *, plugin: bool, probe: Path | None = None) -> Server:
    """`vllm serve` of the campaign (16 sequences, logprobs up to 20); the probe plugin when `probe`."""
    env = {} if probe is None else {"PYTHONPATH": f"{PROBE_DIR}", "TS_STATE_PROBE_FILE": str(probe)}
    plugins = [PROBE_PLUGIN] if probe is not None else []
    return Server(path, vocab.model, max_model_len=vocab.max_model_len, log=log, plugin=plugin, flags=SERVE,
                  plugins=plugins, env=env)


def run_arm(path: Path, vocab: Vocabulary, requests: list, scratch: Path, *, plugin: bool,
            concurrency: int) -> dict[str, Any]:
    """One arm: a server, the load, the replays (with the plugin), the engine's health after."""
    name = "plugin" if plugin else "vllm"
    server = serve(path, vocab, scratch / f"serve-{name}.log", plugin=plugin)
    try:
        start = time.monotonic()
        outcomes = run_load(server.url, requests, server.alive, concurrency=concurrency)
        seconds = time.monotonic() - start
        replays = replay_alone(server.url, requests, outcomes, server.alive) if plugin else None
        healthy = server.alive() and greedy_check(server.url, vocab.model)
        return {"outcomes": outcomes, "seconds": round(seconds, 1), "replays": replays,
                "alive_after": healthy, "exited": server.process.poll() is not None,
                "log_tail": "" if healthy else server.tail()}
    finally:
        server.stop()


def run_campaign(path: Path, vocab: Vocabulary, *, count: int, seed: int, scratch: Path,
                 concurrency: int = 16, kinds: Sequence[str] = ()) -> dict[str, Any]:
    """Both arms on the same requests, and the findings; `kinds`: only requests of those kinds
    (`serve_requests.KINDS`, no edge requests), to chase one kind's rare answers."""
    requests = campaign_requests(count, seed, vocab, kinds)
    arms = {"plugin": run_arm(path, vocab, requests, scratch, plugin=True, concurrency=concurrency),
            "vllm": run_arm(path, vocab, requests, scratch, plugin=False, concurrency=concurrency)}
    findings = compare(requests, arms["plugin"]["outcomes"], arms["vllm"]["outcomes"], vocab.size)
    findings["alive_after"] = {arm: result["alive_after"] for arm, result in arms.items()}
    findings["replays"] = arms["plugin"]["replays"]
    return {"requests": len(requests), "seed": seed, "model": vocab.model, "concurrency": concurrency,
            "seconds": {arm: result["seconds"] for arm, result in arms.items()},
            "by_kind": by_kind(requests, {arm: r["outcomes"] for arm, r in arms.items()}),
            "findings": findings,
            "log_tails": {arm: r["log_tail"] for arm, r in arms.items() if r["log_tail"]},
            "per_request": [{"index": q.index, "kind": q.kind, "endpoint": q.endpoint, "body": q.body,
                             "plugin": outcomes_json([p])[0], "vllm": outcomes_json([v])[0]}
                            for q, p, v in zip(requests, arms["plugin"]["outcomes"], arms["vllm"]["outcomes"])]}


def failures(report: dict[str, Any]) -> list[str]:
    """The campaign's requirements that failed (empty: every one holds)."""
    f = report["findings"]
    replays = f["replays"]
    checks = {"an engine died": sum(f["deaths"].values()) or not all(f["alive_after"].values()),
              "5xx with the plugin where vLLM is not": f["plugin_5xx_where_vllm_is_not"],
              "unexplained accept/refuse mismatches": f["mismatched_unexplained"],
              "invalid token ids": sum(f["invalid_ids"].values()),
              "ids outside allowed_token_ids with the plugin": f["outside_allowed"]["plugin"],
              "seeded replays differ": replays["differ"]}
    return [name for name, bad in checks.items() if bad]


def run_soak(path: Path, vocab: Vocabulary, *, minutes: float, interval: float, seed: int,
             scratch: Path, concurrency: int = 16) -> dict[str, Any]:
    """The soak on a server with the plugin and the probe."""
    probe = scratch / "probe.json"
    server = serve(path, vocab, scratch / "serve-soak.log", plugin=True, probe=probe)
    try:
        return soak(server.url, vocab, seconds=minutes * 60, interval=interval, seed=seed, probe=probe,
                             rss=server.rss, alive=server.alive, concurrency=concurrency)
    finally:
        server.stop()
