"""The real operator mints each endpoint's queue credential (an in-memory Kubernetes API, a real
nats-server in decentralised-JWT mode configured from the installation's keys).

- Each LLMEndpoint gets a Secret <name>-queue-creds-v2 (labelled, owned by the endpoint) holding a
  creds file minted for that endpoint alone; its pods mount it (JOBS_QUEUE_CREDS_FILE) and the
  URL they get holds no password.
- The operator created the endpoint's worker consumers with its own credential.
- Two endpoints named `chat` in two namespaces get two credentials: each reaches its own
  endpoint's consumers and not the other's.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time

import nats.errors
import nats.js.errors
import pytest
import pytest_asyncio
from llmendpoints_common.identity import EndpointRef
from llmendpoints_common.queue import names, natsjwt, roles
from llmendpoints_common.queue.client import QueueConnection
from llmendpoints_common.queue.trust import Installation, mint, server_config

from .kube_emulator import CHILD_RESOURCES, LLMEP, Cluster, Operator, endpoint, until
from .nats_kit import running_nats

pytestmark = [pytest.mark.kube, pytest.mark.asyncio(loop_scope="module")]

SECRETS = CHILD_RESOURCES["Secret"]
DEPLOYMENTS = CHILD_RESOURCES["Deployment"]


@pytest.fixture(scope="module")
def queue(tmp_path_factory, request):
    """A JWT-mode nats-server, the installation's keys on disk, and OPERATOR_ENV pointing the
    operator at both (set before the operator fixture reads it)."""
    tmp = tmp_path_factory.mktemp("queue-creds")
    installation = Installation.generate()
    keys = tmp / "keys"
    keys.mkdir()
    (keys / "account").write_text(installation.account.seed)
    (keys / "account-signing").write_text(installation.account_signing.seed)
    (tmp / "auth.conf").write_text(server_config(installation))
    config = f"jetstream {{ store_dir: {tmp / 'js'} }}\ninclude auth.conf\n"
    with running_nats(tmp, config, config_path=tmp / "nats.conf", store_flags=False) as server:
        request.module.OPERATOR_ENV = {
            "LLMEP_OPERATOR_JOBS_QUEUE_URL": server.url,
            "LLMEP_OPERATOR_JOBS_QUEUE_KEYS_DIR": str(keys),
            "LLMEP_OPERATOR_RESYNC_SECONDS": "3",
        }
        yield server.url, installation, server.log_path


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def running(queue, cluster: Cluster, operator: Operator):
    # `queue` first: it sets the OPERATOR_ENV the operator fixture starts with.
    yield queue, cluster, operator


def _creds(cluster: Cluster, ns: str, name: str) -> str | None:
    secret = cluster.get(SECRETS, ns, f"{name}-queue-creds-v2")
    if secret is None:
        return None
    return base64.b64decode(secret["data"]["queue.creds"]).decode()


async def test_each_endpoint_gets_its_own_credential(running) -> None:
    (url, installation, log), cluster, operator = running
    spec = {"model": {"name": "org/model"}}
    for ns in ("team-a", "team-b"):
        await cluster.create(LLMEP, ns, endpoint("chat", ns, spec))
    await until(operator, lambda: all(_creds(cluster, ns, "chat") for ns in ("team-a", "team-b")),
                "both queue credential Secrets")  # fmt: skip
    a, b = EndpointRef("team-a", "chat"), EndpointRef("team-b", "chat")
    for ref in (a, b):
        secret = cluster.get(SECRETS, ref.namespace, "chat-queue-creds-v2")
        assert secret["metadata"]["labels"]["app.kubernetes.io/managed-by"] == (
            "llmendpoints-operator"
        )
        (owner,) = secret["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"]) == ("LLMEndpoint", "chat")
        token, _ = natsjwt.parse_creds(_creds(cluster, ref.namespace, "chat"))
        claims = natsjwt.verify(token)
        # Signed by the installation's signing key, for this endpoint alone.
        assert claims["iss"] == installation.account_signing.public
        assert claims["nats"]["issuer_account"] == installation.account.public
        assert claims["name"] == f"runtime:{ref.id}"
        assert natsjwt.Permissions.from_claims(claims) == roles.runtime(ref)

    # The Secrets are written before the Deployment (whose pods mount them), and the fit check
    # runs in between.
    deployment = await until(
        operator, lambda: cluster.get(DEPLOYMENTS, "team-a", "chat"), "the Deployment"
    )
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {v["name"]: v.get("value") for v in container["env"]}
    assert env["JOBS_QUEUE_URL"] == url  # no password in it
    assert env["JOBS_QUEUE_CREDS_FILE"] == "/etc/llmendpoints/queue/queue.creds"
    assert env["ENDPOINT_NAMESPACE"] == "team-a" and env["ENDPOINT_ID"] == "chat"

    # The operator created each endpoint's worker consumers; A's credential reads A's, not B's.
    pod_a = await QueueConnection.connect(
        url, name="pod-a", creds=_creds(cluster, "team-a", "chat"), request_timeout=0.5
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                await pod_a.js.consumer_info(names.queue_stream(a), names.jobs_consumer(a))
                break
            except Exception:
                assert time.monotonic() < deadline, log.read_text()[-2000:]
                await asyncio.sleep(0.2)
        with pytest.raises(nats.errors.TimeoutError):
            await pod_a.js.consumer_info(names.queue_stream(b), names.jobs_consumer(b))
    finally:
        await pod_a.close()
    admin = await QueueConnection.connect(
        url, name="admin", creds=mint(installation.signer, "admin", issued_at=int(time.time()))
    )
    try:
        info = await admin.js.consumer_info(names.queue_stream(b), names.jobs_consumer(b))
        assert info.config.filter_subject == names.jobs_consumer_filter(b, "normal")
        # Its own two streams, bounded, and the gateway's usage consumer on its records.
        for stream in (names.queue_stream(b), names.records_stream(b)):
            assert (await admin.js.stream_info(stream)).config.max_bytes > 0
        usage = await admin.js.consumer_info(names.records_stream(b), names.USAGE_CONSUMER)
        assert usage.config.filter_subject == names.records_filter(b)
    finally:
        await admin.close()


async def test_an_existing_secret_is_left_alone_and_recreated_when_deleted(running) -> None:
    """Created once, never rewritten (the operator may create Secrets, not read or update
    them); deleting it is how a credential is minted again."""
    _, cluster, operator = running
    await cluster.create(LLMEP, "team-a", endpoint("again", "team-a", {"model": {"name": "m"}}))
    await until(operator, lambda: _creds(cluster, "team-a", "again"), "the Secret")
    first = _creds(cluster, "team-a", "again")
    await asyncio.sleep(4)  # a resync or two
    assert _creds(cluster, "team-a", "again") == first
    await cluster.delete(SECRETS, "team-a", "again-queue-creds-v2")
    await until(
        operator,
        lambda: (_creds(cluster, "team-a", "again") or first) != first,
        "a new credential after the Secret was deleted",
    )


async def test_a_deleted_endpoints_own_streams_go_with_it(running) -> None:
    """Every endpoint's two streams reserve their bound on the NATS servers: when the endpoint
    is deleted the operator deletes them (its jobs go with it, and the reservation is freed);
    another endpoint's stay."""
    (url, installation, log), cluster, _ = running
    gone, kept = EndpointRef("team-a", "gone"), EndpointRef("team-a", "kept")
    for ref in (gone, kept):
        await cluster.create(LLMEP, ref.namespace, endpoint(ref.name, ref.namespace, {"model": {"name": "m"}}))  # fmt: skip
    admin = await QueueConnection.connect(
        url, name="admin", creds=mint(installation.signer, "admin", issued_at=int(time.time()))
    )

    async def streams(ref: EndpointRef) -> list[str]:
        found = []
        for stream in (names.queue_stream(ref), names.records_stream(ref)):
            with contextlib.suppress(nats.js.errors.NotFoundError):
                found.append((await admin.js.stream_info(stream)).config.name)
        return found

    try:
        deadline = time.monotonic() + 30
        while len(await streams(gone)) < 2 or len(await streams(kept)) < 2:
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            await asyncio.sleep(0.2)
        await cluster.delete(LLMEP, gone.namespace, gone.name)
        while await streams(gone):
            assert time.monotonic() < deadline, "the deleted endpoint's streams stayed"
            await asyncio.sleep(0.2)
        assert len(await streams(kept)) == 2
    finally:
        await admin.close()
