"""The operator's path through the chart's artifact store, as close to a cluster as this machine
allows: the worker's container rendered by Helm (with `store.url` an OCI registry and its login
Secret) run as a local process; a real distribution registry (Debian's `docker-registry`) as the
store; an adapter registered from another HOME, as from an operator's laptop. With the store the
worker answers as HF+PEFT does; an adapter recorded in the laptop's own directory is the 503 the
store prevents. Then a fleet: two such workers and the router on a throwaway PostgreSQL registry,
serving an adapter added from the laptop and one published through a worker, both from the store."""

from __future__ import annotations

import base64
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import helm_python as helm
import httpx
import pytest
import yaml
from test_guide_commands import _command_lines, _words
from tinymodels import make_adapter, peft_reference, reference_greedy

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "loraplex"
REGISTRY_BIN = shutil.which("docker-registry") or "/usr/bin/docker-registry"
pytestmark = pytest.mark.skipif(
    not Path(REGISTRY_BIN).exists(),
    reason="needs Debian's docker-registry (apt-get install docker-registry; CI installs it)",
)
USER, PASSWORD = "operator", "store-pass-0123"
API_KEY, ADMIN_TOKEN = "acme-key-0123456789", "admin-token-0123456789"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def oci_store(tmp_path_factory):
    """host:port of a distribution registry with an htpasswd login, stopped at the end."""
    import bcrypt

    root, port = tmp_path_factory.mktemp("oci"), _free_port()
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    (root / "htpasswd").write_text(f"{USER}:{hashed}\n")
    config = {
        "version": 0.1,
        "log": {"level": "warn", "accesslog": {"disabled": True}},
        "storage": {"filesystem": {"rootdirectory": str(root / "storage")}},
        "http": {"addr": f"127.0.0.1:{port}"},
        "auth": {"htpasswd": {"realm": "loraplex", "path": str(root / "htpasswd")}},
    }
    (root / "config.yml").write_text(json.dumps(config))
    log = (root / "registry.log").open("wb")
    proc = subprocess.Popen(
        [REGISTRY_BIN, "serve", str(root / "config.yml")], stdout=log, stderr=log
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/v2/")
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None, "no registry"
                time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def _docker_config(path: Path, host: str) -> Path:
    """A docker config file: what `docker login` writes, and what a dockerconfigjson Secret is."""
    auth = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"auths": {host: {"auth": auth}}}))
    return path


def _render(store: dict) -> dict[str, list[dict]]:
    """The chart's objects with these store values, by template file name."""
    with helm.Chart.load(CHART) as chart:
        out = chart.render({"store": store}, name="loraplex", namespace="ml", is_install=True)
    return {
        Path(p).name: [o for o in yaml.safe_load_all(t) if o]
        for p, t in out.items()
        if p.endswith(".yaml")
    }


def _rendered_worker(store_url: str) -> tuple[dict, str]:
    """The worker's container and its serve.yaml, as Helm renders them with the store."""
    config, deployment = _render({"url": store_url, "secret": {"name": "loras-pull"}})[
        "worker.yaml"
    ][:2]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return container, config["data"]["serve.yaml"]


def _local(pod: Path, path: str) -> Path:
    return pod / path.lstrip("/")


def _start_worker(pod: Path, container: dict, serve_yaml: str, model: Path, env: dict):
    """The container's command line as a local process: its files under `pod`, `$(VAR)` from its
    environment, on free loopback ports."""
    _local(pod, "/etc/loraplex/serve.yaml").parent.mkdir(parents=True)
    _local(pod, "/etc/loraplex/serve.yaml").write_text(serve_yaml)
    keys = _local(pod, "/var/run/secrets/loraplex-keys/api-keys")
    keys.parent.mkdir(parents=True)
    keys.write_text(f"acme {API_KEY}\n")
    token = _local(pod, "/var/run/secrets/loraplex-admin/token")
    token.parent.mkdir(parents=True)
    token.write_text(ADMIN_TOKEN + "\n")
    for item in container["env"]:
        if "value" in item:
            value = item["value"]
            env[item["name"]] = str(_local(pod, value)) if value.startswith("/") else value
    args = []
    for arg in container["args"]:
        arg = re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], arg)
        flag, _, value = arg.partition("=")
        if flag == "--model":
            value = str(model)
        elif flag in ("--host", "--port", "--admin-port"):
            value = {"--host": "127.0.0.1", "--port": "0", "--admin-port": "0"}[flag]
        elif value.startswith("/"):
            value = str(_local(pod, value))
        args.append(f"{flag}={value}")
    command = [sys.executable, "-m", "loraplex.cli", *container["command"][1:], *args]
    stderr = (pod / "stderr.log").open("w")
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=stderr, text=True, env={**env, "HOME": str(pod)}
    )
    return proc, stderr


def _addresses(proc, prefixes: tuple[str, ...], timeout: float = 180.0) -> list[str]:
    """The URLs the process prints on the lines that start with `prefixes`, in that order."""
    found: list[str] = []

    def read():
        for line in proc.stdout:
            if line.startswith(prefixes[len(found)]):
                found.append(line.split(" on ", 1)[1].split()[0].strip())
                if len(found) == len(prefixes):
                    return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    assert len(found) == len(prefixes), f"the process printed {found}, not {prefixes}"
    return found


def _address(proc) -> str:
    return _addresses(proc, ("loraplex serving",))[0]


def _laptop(home: Path, *args) -> subprocess.CompletedProcess:
    """`loraplex registry ...` from the operator's machine: its own HOME and docker login."""
    return subprocess.run(
        [sys.executable, "-m", "loraplex.cli", "registry", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=180,
        env={"PATH": "/usr/bin:/bin", "HOME": str(home), "PYTHONPATH": str(ROOT / "src")},
    )


def test_an_adapter_registered_from_a_laptop_into_the_chart_store_is_answered_right(
    oci_store, llama_dir, tmp_path
):
    store_url = f"oci+http://{oci_store}/loras"
    container, serve_yaml = _rendered_worker(store_url)
    assert yaml.safe_load(serve_yaml)["allowed-roots"] == [store_url]
    adapter = make_adapter(llama_dir, tmp_path / "sql", seed=7, r=4, lora_alpha=8)
    registry = f"sqlite:///{tmp_path / 'registry' / 'registry.db'}"
    laptop = tmp_path / "laptop"
    _docker_config(laptop / ".docker" / "config.json", oci_store)
    store_args = ["--registry", registry, "--store", laptop / "artifacts"]
    assert _laptop(laptop, *store_args, "init").returncode == 0
    added = _laptop(
        laptop, *store_args, "--storage-base", store_url, "add", adapter, "--name", "sql",
        "--base-model", llama_dir, "--stable", "--json",
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    assert json.loads(added.stdout)["storage_uri"].startswith(store_url + "@sha256:")
    # another adapter, recorded in the laptop's own directory: what the store prevents
    other = make_adapter(llama_dir, tmp_path / "other", seed=8, r=4, lora_alpha=8)
    local = _laptop(laptop, *store_args, "add", other, "--name", "stranded", "--stable", "--json")
    assert json.loads(local.stdout)["storage_uri"].startswith((laptop / "artifacts").as_uri())

    pod = tmp_path / "pod"
    _docker_config(_local(pod, "/var/run/secrets/loraplex-store/config.json"), oci_store)
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(ROOT / "src"),
        "LORAPLEX_REGISTRY_URL": registry,
    }
    proc, stderr = _start_worker(pod, container, serve_yaml, llama_dir, env)
    try:
        url = _address(proc)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        body = {"prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(
            f"{url}/v1/completions", json={**body, "model": "sql"}, headers=headers, timeout=120
        )
        assert answer.status_code == 200, answer.text
        stranded = httpx.post(
            f"{url}/v1/completions",
            json={**body, "model": "stranded"},
            headers=headers,
            timeout=120,
        )
        assert stranded.status_code == 503, stranded.text
        assert "could not be loaded" in stranded.json()["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(60)
        stderr.close()
    assert "outside the allowed roots" in (pod / "stderr.log").read_text()

    assert answer.json()["choices"][0]["text"] == _peft_answer(llama_dir, adapter, "hello", 6)


def _loraplex(home: Path, *args) -> subprocess.CompletedProcess:
    """`loraplex ...` from the operator's machine: its own HOME and docker login."""
    return subprocess.run(
        [sys.executable, "-m", "loraplex.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=180,
        env={"PATH": "/usr/bin:/bin", "HOME": str(home), "PYTHONPATH": str(ROOT / "src")},
    )


def _start(command: list, log: Path, env: dict) -> tuple[subprocess.Popen, object]:
    stderr = log.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "loraplex.cli", *map(str, command)],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
    )
    return proc, stderr


def _wait_ready(url: str, timeout: float = 60.0) -> None:
    """Until `url`/ready answers 200 (the router prints its address before uvicorn listens)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{url} is not ready"
        time.sleep(0.1)


def _complete(url: str, model: str, headers: dict) -> httpx.Response:
    body = {"model": model, "prompt": "hello", "max_tokens": 6, "temperature": 0}
    return httpx.post(
        f"{url}/v1/completions", json={**body, "ignore_eos": True}, headers=headers, timeout=120
    )


def _guide_commands(**words: str) -> dict[str, list[str]]:
    """docs/deploy.md's `loraplex` commands of its install steps, by subcommand (`init`, `add`,
    `publish`), each word in `words` (the guide's placeholders) replaced by its value here."""
    found = {}
    for line in _command_lines(ROOT / "docs" / "deploy.md"):
        command = [words.get(w, w) for w in _words(line) or []]
        for name in ("init", "add", "publish"):
            if name in command:
                found[name] = command
    return found


def test_a_fleet_on_postgresql_serves_what_the_operator_and_a_trainer_put_in_the_shared_store(
    oci_store, pg_url, llama_dir, tmp_path
):
    """Two chart workers and the router on one PostgreSQL registry: an adapter the operator adds
    from a laptop and one a trainer publishes through the first worker, each with deploy.md's own
    command line, both land in the OCI store, and every worker answers both as HF+PEFT does,
    directly and through the router."""
    store_url = f"oci+http://{oci_store}/loras"
    container, serve_yaml = _rendered_worker(store_url)
    assert f"--storage-base={store_url}" in container["args"]
    laptop = tmp_path / "laptop"
    _docker_config(laptop / ".docker" / "config.json", oci_store)
    adapters = {
        "sql": make_adapter(llama_dir, tmp_path / "sql", seed=7, r=4, lora_alpha=8),
        "pub": make_adapter(llama_dir, tmp_path / "pub", seed=9, r=4, lora_alpha=8),
    }
    for adapter in adapters.values():  # as a trainer saves it: the base named by its hub id
        config = json.loads((adapter / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = "meta-llama/Llama-3.1-8B"
        (adapter / "adapter_config.json").write_text(json.dumps(config))
    at = ["--registry", pg_url]
    guide = _guide_commands(
        **{"$URL": pg_url, "oci://registry.internal/loras": store_url},
        **{"./adapters/sql": str(adapters["sql"]), "./models/base": str(llama_dir)},
    )
    assert _loraplex(laptop, *guide["init"]).returncode == 0
    added = _loraplex(laptop, *guide["add"])
    assert added.returncode == 0, added.stderr
    assert not (laptop / ".local" / "share" / "loraplex" / "registry.db").exists()

    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src")}
    env["LORAPLEX_REGISTRY_URL"] = pg_url
    started, urls, admin_urls = [], [], []
    try:
        for pod in (tmp_path / "pod-a", tmp_path / "pod-b"):
            _docker_config(_local(pod, "/var/run/secrets/loraplex-store/config.json"), oci_store)
            started.append(_start_worker(pod, container, serve_yaml, llama_dir, dict(env)))
        for proc, _ in started:
            url, admin = _addresses(proc, ("loraplex serving", "loraplex admin API"))
            urls.append(url)
            admin_urls.append(admin)
        token_file = tmp_path / "pod-a" / "var/run/secrets/loraplex-admin/token"
        here = {"http://127.0.0.1:8001": admin_urls[0], "admin-token.txt": str(token_file)}
        here |= {str(adapters["sql"]): str(adapters["pub"]), "sql": "pub"}
        published = _loraplex(laptop, *[here.get(w, w) for w in guide["publish"]])
        assert published.returncode == 0, published.stderr
        shown = _laptop(laptop, *at, "show", "pub", "--json")
        uri = json.loads(shown.stdout)["revisions"][0]["storage_uri"]
        assert uri.startswith(store_url + "@sha256:"), uri

        router_cmd = ["router", "--registry", pg_url, "--port", "0"]
        router_cmd += [f"--worker={url}" for url in urls]
        started.append(_start(router_cmd, tmp_path / "router.log", env))
        router = _addresses(started[-1][0], ("loraplex router listening",))[0]
        _wait_ready(router)
        answers = {model: _answers(router, urls, model) for model in adapters}
    finally:
        for proc, log in started:
            proc.terminate()
            proc.wait(60)
            log.close()
    for model, adapter in adapters.items():
        expected = _peft_answer(llama_dir, adapter, "hello", 6)
        assert answers[model] == {"router": expected, "a": expected, "b": expected}, model


def _answers(router: str, workers: list[str], model: str) -> dict[str, str]:
    """The model's answer through the router and from each worker ("a", "b", ...) directly."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    routed = _complete(router, model, headers)
    assert routed.status_code == 200, routed.text
    assert routed.headers["x-loraplex-worker"] in workers
    out = {"router": routed.json()["choices"][0]["text"]}
    for name, url in zip("ab", workers, strict=True):
        direct = _complete(url, model, headers)
        assert direct.status_code == 200, (name, direct.text)
        out[name] = direct.json()["choices"][0]["text"]
    return out


@pytest.fixture
def bundled_store(tmp_path):
    """The chart's bundled store (`store.bundled.enabled`) as a local process: its container's
    environment over a minimal config file, its volume under tmp_path, on a loopback port.
    Yields (the objects rendered, the worker's store URL, its address here)."""
    objects = _render({"bundled": {"enabled": True}})
    container = objects["store.yaml"][1]["spec"]["template"]["spec"]["containers"][0]
    port, root = _free_port(), tmp_path / "store-pod"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["REGISTRY_HTTP_ADDR"] == ":5000"
    env["REGISTRY_HTTP_ADDR"] = f"127.0.0.1:{port}"
    env["REGISTRY_STORAGE_FILESYSTEM_ROOTDIRECTORY"] = str(
        _local(root, env["REGISTRY_STORAGE_FILESYSTEM_ROOTDIRECTORY"])
    )
    (root / "config.yml").parent.mkdir(parents=True)
    (root / "config.yml").write_text(
        json.dumps({"version": 0.1, "storage": {"filesystem": {"rootdirectory": "/nowhere"}}})
    )
    log = (root / "registry.log").open("wb")
    proc = subprocess.Popen(
        [REGISTRY_BIN, "serve", str(root / "config.yml")],
        stdout=log,
        stderr=log,
        env={"PATH": "/usr/bin:/bin", **env},
    )
    try:
        _wait_ready_path(f"http://127.0.0.1:{port}/v2/", proc)
        yield objects, "oci+http://loraplex-store:5000/loras", f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def _wait_ready_path(url: str, proc, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None, f"{url} did not answer"
        time.sleep(0.05)


def test_the_bundled_store_takes_a_publish_through_a_worker_and_serves_it(
    bundled_store, pg_url, llama_dir, tmp_path
):
    """The quick start's store: a worker rendered with `store.bundled.enabled` (its in-cluster
    name read as this machine's loopback address) pushes what the operator publishes through it
    into the bundled registry, and answers it as HF+PEFT does."""
    objects, in_cluster, here = bundled_store
    config, deployment = objects["worker.yaml"][:2]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert f"--storage-base={in_cluster}" in container["args"]
    assert yaml.safe_load(config["data"]["serve.yaml"])["allowed-roots"] == [in_cluster]
    local_url = in_cluster.replace("loraplex-store:5000", here)
    container["args"] = [a.replace(in_cluster, local_url) for a in container["args"]]
    serve_yaml = config["data"]["serve.yaml"].replace(in_cluster, local_url)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src")}
    env["LORAPLEX_REGISTRY_URL"] = pg_url
    pod, laptop = tmp_path / "pod", tmp_path / "laptop"
    adapter = make_adapter(llama_dir, tmp_path / "sql", seed=11, r=4, lora_alpha=8)
    proc, stderr = _start_worker(pod, container, serve_yaml, llama_dir, env)
    try:
        url, admin = _addresses(proc, ("loraplex serving", "loraplex admin API"))
        published = _loraplex(
            laptop, "publish", adapter, "--name", "sql", "--url", admin,
            "--admin-token-file", _local(pod, "/var/run/secrets/loraplex-admin/token"), "--stable",
        )  # fmt: skip
        assert published.returncode == 0, published.stderr
        answer = _complete(url, "sql", {"Authorization": f"Bearer {API_KEY}"})
    finally:
        proc.terminate()
        proc.wait(60)
        stderr.close()
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == _peft_answer(llama_dir, adapter, "hello", 6)
    shown = _laptop(laptop, "--registry", pg_url, "show", "sql", "--json")
    uri = json.loads(shown.stdout)["revisions"][0]["storage_uri"]
    assert uri.startswith(local_url + "@sha256:"), uri
    manifest = httpx.get(
        f"http://{here}/v2/loras/manifests/{uri.rsplit('@', 1)[1]}",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
        timeout=10,
    )
    assert manifest.status_code == 200, manifest.text  # in the bundled registry


def _peft_answer(model: Path, adapter: Path, prompt: str, max_tokens: int) -> str:
    """HF+PEFT's greedy answer, detokenized a token at a time after the prompt (as servers do:
    half a character at the end is left out)."""
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    ids = tokenizer.encode(prompt).ids
    tokens = reference_greedy(peft_reference(model, {"sql": adapter}), ids, "sql", max_tokens)
    stream = DecodeStream(ids=ids[-8:], skip_special_tokens=True)
    return "".join(stream.step(tokenizer, t) or "" for t in tokens)
