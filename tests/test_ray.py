"""plinth on a Ray cluster: Ray Serve replicas of `plinth serve`, and a model split over Ray actors.

Opt-in (``make test-ray``, ``pytest -m ray``): needs the ``ray`` extra. A two-node Ray cluster is
started on this machine (``ray.cluster_utils.Cluster``: a head node and a second node process
joining it, both at 127.0.0.1) and torn down at the end. Ray's own gRPC services bind every
interface and have no loopback-only setting, so the suite runs only inside a network namespace
with nothing but loopback (``make test-ray`` wraps pytest in ``unshare -rn``); elsewhere it skips
unless ``PLINTH_RAY_ANY_INTERFACE=1`` says that is acceptable on this machine.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import socket
import sys
import threading
import time

import numpy as np
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
TIMEOUT = 300.0
QUESTIONS = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?", "Say hello.",
             "What is a plinth?", "Give me a word that rhymes with cat.", "What do bees make?",
             "Which planet is the largest?"]


def _loopback_only() -> bool:
    return {name for _, name in socket.if_nameindex()} <= {"lo"}


@pytest.fixture(scope="module", autouse=True)  # module scope: it runs before the cluster fixture
def _opt_in(request):
    if "ray" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("opt-in suite: run with -m ray (make test-ray)")
    if not _loopback_only() and os.environ.get("PLINTH_RAY_ANY_INTERFACE") != "1":
        pytest.skip("Ray's services bind every interface: run inside `unshare -rn` (make test-ray does), or set "
                    "PLINTH_RAY_ANY_INTERFACE=1")


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    if os.environ.get("OPENBLAS_NUM_THREADS") != "1":
        pytest.fail("run with OPENBLAS_NUM_THREADS=1 from the start (make test-ray does): the stages and replicas "
                    "use one BLAS thread, and a GEMM's result depends on its thread count")
    # the dashboard (127.0.0.1 only) serves Ray's state API, which the tests read
    c = Cluster(initialize_head=True,
                head_node_args={"num_cpus": 2, "include_dashboard": True, "dashboard_host": "127.0.0.1"})
    c.add_node(num_cpus=2)
    c.wait_for_nodes()
    ray.init(address=c.address, include_dashboard=False, logging_level="warning")
    try:
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def model_path():
    from plinth import hub

    return hub.resolve_model(MODEL)


@pytest.fixture(scope="module")
def replicas(cluster, model_path, tmp_path_factory):
    from plinth.testing.server import free_port, served

    port = free_port()
    log = tmp_path_factory.mktemp("ray") / "serve.log"
    cmd = [sys.executable, "-m", "plinth", "serve", "-m", str(model_path), "--ray", "2", "--ray-address",
           cluster.address, "--port", str(port), "--max-batch", "8", "--max-queue", "32", "--n-ctx", "1024",
           ]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PLINTH_THREADS": "1", "PLINTH_PLUGINS": "llama"}
    with served(cmd, port, timeout=TIMEOUT, log=log, env=env) as srv:
        yield srv


def _client(url: str, retries: int = 0):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=retries)


def _generate(capsys, path, prompt: str, *args: str) -> str:
    from plinth.cli import main

    capsys.readouterr()
    assert main(["generate", "-m", str(path), prompt, *args]) == 0
    out = capsys.readouterr().out
    return out[:-1]


def _replica_actors() -> dict[str, str]:
    """The live Ray Serve replica actors: name -> node id."""
    from ray.util.state import list_actors

    return {a["name"]: a["node_id"] for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
            if a["class_name"].startswith("ServeReplica")}


def _ask(c, model: str, q: str, max_tokens: int = 24) -> str:
    stream = c.chat.completions.create(model=model, messages=[{"role": "user", "content": q}],
                                       max_tokens=max_tokens, temperature=0, stream=True)
    return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)


# ---------------------------------------------------------------- replicas behind Ray Serve


def test_two_replicas_on_two_nodes_greedy_equals_generate(replicas, model_path, capsys):
    actors = _replica_actors()
    assert len(actors) == 2, actors
    assert len(set(actors.values())) == 2, "Ray Serve spreads the two replicas over the two nodes"
    c = _client(replicas.url)
    model = c.models.list().data[0].id
    want = {q: _generate(capsys, model_path, q, "--chat", "-n", "24", "--temperature", "0") for q in QUESTIONS[:4]}
    got = {q: _ask(c, model, q) for q in QUESTIONS[:4]}
    assert got == want
    # the plugin selection of the deploying command (PLINTH_PLUGINS=llama) is in every replica's
    # runtime environment, and a replica answering /health loaded exactly that set (+ the core)
    import json

    import httpx
    from ray.util.state import list_actors

    envs = [json.loads(a["serialized_runtime_env"]).get("env_vars", {})
            for a in list_actors(filters=[("state", "=", "ALIVE")], detail=True, limit=1000)
            if a["class_name"].startswith("ServeReplica")]
    assert len(envs) == 2 and all(e.get("PLINTH_PLUGINS") == "llama" for e in envs), envs
    assert httpx.get(replicas.url + "/health", timeout=30).json()["plugins"] == ["plinth", "llama"]
    r = c.completions.create(model=model, prompt="The sea is", max_tokens=16, temperature=0)
    assert r.choices[0].text == _generate(capsys, model_path, "The sea is", "-n", "16", "--temperature", "0")


def test_sixteen_concurrent_clients_lose_nothing(replicas, model_path, capsys):
    c = _client(replicas.url)
    model = c.models.list().data[0].id
    want = {q: _generate(capsys, model_path, q, "--chat", "-n", "16", "--temperature", "0") for q in QUESTIONS}
    jobs = [QUESTIONS[i % len(QUESTIONS)] for i in range(16)]
    start = threading.Barrier(len(jobs), timeout=TIMEOUT)

    def one(q: str) -> str:
        start.wait()
        return _ask(c, model, q, max_tokens=16)

    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(one, jobs, timeout=TIMEOUT))
    assert got == [want[q] for q in jobs]  # all 16 answered, each equal to a solo run


def test_killing_a_replica_loses_no_request_that_had_not_started(replicas):
    """Clients stream back to back; one replica's actor is killed mid-load. A request whose stream
    had not opened yet is retried by the client (openai's own retries on 5xx and connection
    errors) and must succeed; one cut after its stream opened is counted, not failed. Ray Serve then brings
    the deployment back to 2 healthy replicas, which answer."""
    import ray
    from ray import serve

    c = _client(replicas.url, retries=5)
    model = c.models.list().data[0].id
    stop = time.monotonic() + 60
    killed = threading.Event()
    results = {"ok": 0, "cut_mid_stream": 0, "lost": []}
    lock = threading.Lock()

    def client_loop(i: int) -> None:
        while time.monotonic() < stop and not (killed.is_set() and results["ok"] >= 24):
            started = finished = False  # started: the server answered 200 and the event stream is open
            error = "the stream ended without a finish_reason"
            try:
                stream = c.chat.completions.create(model=model, max_tokens=24, temperature=0, stream=True,
                                                   messages=[{"role": "user", "content": QUESTIONS[i % 8]}])
                started = True
                for ch in stream:
                    if ch.choices and ch.choices[0].finish_reason:
                        finished = True
            except Exception as exc:  # noqa: BLE001 - classified below
                error = f"{type(exc).__name__}: {exc}"
            with lock:
                if finished:
                    results["ok"] += 1
                elif started:
                    results["cut_mid_stream"] += 1
                else:  # refused or broken before the stream opened, even after the client's retries
                    results["lost"].append(error)

    from ray.util.state import list_actors

    proxy_node = [a["node_id"] for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
                  if a["class_name"] == "ProxyActor"][0]
    with cf.ThreadPoolExecutor(12) as pool:  # more than one replica's batch (8): both are busy
        futures = [pool.submit(client_loop, i) for i in range(12)]
        time.sleep(6)
        # the replica on the proxy's node: Ray Serve sends it requests first, so it is busy for sure
        victim = [name for name, node in _replica_actors().items() if node == proxy_node][0]
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        killed.set()
        for f in futures:
            f.result(timeout=TIMEOUT)
    assert not results["lost"], results
    assert results["ok"] >= 8, results
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        app = serve.status().applications.get("plinth")
        dep = app.deployments.get("plinth") if app else None
        if dep and dep.replica_states.get("RUNNING", 0) == 2 and dep.status == "HEALTHY" and victim not in \
                _replica_actors():
            break
        time.sleep(1)
    else:
        pytest.fail(f"the deployment did not recover 2 healthy replicas: {serve.status()}")
    assert _ask(c, model, QUESTIONS[0])
    print(f"\nreplica killed mid-load: {results['ok']} requests completed, {results['cut_mid_stream']} cut "
          f"mid-stream, 0 lost")


# ---------------------------------------------------------------- a model split over Ray actors


@pytest.fixture(scope="module")
def pipeline(cluster, model_path):
    from plinth.pipeline import load_pipeline

    # half a CPU per stage: the cluster's 4 CPUs also hold the 2 replicas and the CLI test's stages
    pm = load_pipeline(str(model_path), 2, threads=1, plugins={"plugins": "llama"}, cpus=0.5)
    try:
        yield pm
    finally:
        pm.close()


def test_pipeline_two_stages_logits_equal_single_process(pipeline, model_path):
    from plinth.model import load_model

    assert pipeline.ranges == [(0, 15), (15, 30)]
    assert len({i["pid"] for i in pipeline.infos}) == 2
    single = load_model(str(model_path), tokenizer=False)
    ids = single.tokenizer.encode("The pipeline splits the model by layers over two Ray actors.")
    want = single.logits(ids)
    got = pipeline.logits(ids)
    assert got.shape == want.shape
    assert np.max(np.abs(got - want)) <= 1e-5
    # each stage brought into memory only its part of the file (its layers; the head on the last)
    size = model_path.stat().st_size
    pages = [w for _, _, w in pipeline.stage_rss()]
    assert all(0 < w < 0.8 * size for w in pages), (pages, size)
    # prefill + decode through the stages' caches equals the same steps in one process
    ctx, one = pipeline.new_context(), single.new_context()
    assert np.max(np.abs(ctx.decode(ids[:-3]).logits - one.decode(ids[:-3]).logits)) <= 1e-5
    for i in range(3, 0, -1):
        got, want_step = ctx.decode([ids[-i]]).logits[-1], one.decode([ids[-i]]).logits[-1]
        assert np.max(np.abs(got - want_step)) <= 1e-5
        assert np.max(np.abs(got - want[-i])) <= 1e-4  # and the full forward (other kernels: m rows vs 1)


@pytest.mark.parametrize("spec", [None, "ngram", "draft"])
def test_pipeline_greedy_output_identical(pipeline, model_path, spec):
    from plinth import generate as gen_mod
    from plinth.model import load_model
    from plinth.plugins import discover
    from plinth.sampling import Sampler, SamplerConfig

    single = load_model(str(model_path))
    # the repetition is in the prompt, so the n-gram drafter drafts whatever the kernels' rounding makes of
    # the continuation (an earlier prompt relied on the model repeating itself, which it stopped doing)
    text = "Write the numbers from one to twenty: one, two, three, one, two, three, one, two,"
    prompt = single.tokenizer.encode(text, add_special=True)
    want = gen_mod.Generator(single).generate(prompt, max_tokens=32)
    if spec is None:
        got = gen_mod.Generator(pipeline, Sampler(SamplerConfig(temperature=0.0))).generate(prompt, max_tokens=32)
    else:
        from plinth.speculative.engine import SpecConfig, SpeculativeGenerator

        registry = discover(plugins="llama")
        options = {"draft": str(model_path), "n_max": 4, "n_min": 0, "p_min": 0.0, "backend": "numpy",
                   "ngram_max": 3, "ngram_min": 2, "progress": False, "temperature": 0.0}
        drafter = registry.make_drafter(spec, pipeline, options)
        g = SpeculativeGenerator(pipeline, [drafter], config=SpecConfig(n_max=4),
                                 sampler=Sampler(SamplerConfig(temperature=0.0)), registry=registry)
        got = g.generate(prompt, max_tokens=32)
        assert g.stats.n_drafted > 0  # the verify batches went through the pipeline
    assert got == want


def test_pipeline_cli_one_command(cluster, model_path, capsys):
    want = _generate(capsys, model_path, "What is a plinth?", "--chat", "-n", "16", "--temperature", "0")
    got = _generate(capsys, model_path, "What is a plinth?", "--chat", "-n", "16", "--temperature", "0",
                    "--ray-stages", "2", "--ray-address", cluster.address, "--ray-cpus", "0.5")
    assert got == want
