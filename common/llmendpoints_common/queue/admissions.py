"""Job admissions in their endpoint's records stream (jobs/admission.py says what they are).

An admission is the last message on ``llmep.ep.<ns>.<name>.adm.<by>.<job id>``: ``gw`` written
by the gateway (a pod's credential may not publish there: queue/roles.py), ``ep`` by one of
the endpoint's pods. Changed only by compare-and-set (``Nats-Expected-Last-Subject-Sequence``),
each write with what is left of its life as TTL.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from nats.js import JetStreamContext
from nats.js.errors import APIError, NotFoundError

from llmendpoints_common.identity import EndpointRef
from llmendpoints_common.jobs import admission
from llmendpoints_common.jobs.admission import JobAdmission
from llmendpoints_common.queue import names
from llmendpoints_common.queue.state import WRONG_LAST_SEQUENCE

_EXPECTED_LAST = "Nats-Expected-Last-Subject-Sequence"
_BY = {admission.GATEWAY: names.ADMITTED_BY_GATEWAY, admission.ENDPOINT: names.ADMITTED_BY_ENDPOINT}


def subject(endpoint: EndpointRef, job_id: str, by: str) -> str:
    return names.admission_subject(endpoint, job_id, _BY[by])


def _ttl(admitted: JobAdmission, now: float) -> int:
    return max(1, round(admitted.expires_at - now))


async def write(js: JetStreamContext, endpoint: EndpointRef, admitted: JobAdmission) -> bool:
    """Store a new job's admission; False when it was admitted before (kept as it was)."""
    try:
        await js.publish(
            subject(endpoint, admitted.id, admitted.by),
            admitted.encode(),
            headers={_EXPECTED_LAST: "0"},
            msg_ttl=_ttl(admitted, time.time()),
        )
    except APIError as exc:
        if exc.err_code == WRONG_LAST_SEQUENCE:
            return False
        raise
    return True


async def _read_one(
    js: JetStreamContext, endpoint: EndpointRef, job_id: str, by: str
) -> tuple[JobAdmission, int] | None:
    try:
        raw = await js.get_msg(
            names.records_stream(endpoint), subject=subject(endpoint, job_id, by), direct=True
        )
    except NotFoundError:
        return None
    if not raw.data:
        return None
    try:
        return JobAdmission.decode(raw.data), raw.seq
    except ValueError:
        return None


async def read(
    js: JetStreamContext, endpoint: EndpointRef, job_id: str
) -> tuple[JobAdmission, int] | None:
    """The job's admission and its revision: the gateway's when there is one (a pod's own
    admission of the same id is then not believed), else the endpoint's."""
    found = await _read_one(js, endpoint, job_id, admission.GATEWAY)
    if found is not None and found[0].by == admission.GATEWAY:
        return found
    found = await _read_one(js, endpoint, job_id, admission.ENDPOINT)
    if found is not None and found[0].by == admission.ENDPOINT:
        return found
    return None


async def update(
    js: JetStreamContext,
    endpoint: EndpointRef,
    job_id: str,
    by: str,
    change: Callable[[JobAdmission], JobAdmission | None],
) -> JobAdmission | None:
    """Apply ``change`` to the admission (of ``by``) until the write wins; ``change`` returns
    None to leave it as it is. None when there is none."""
    while True:
        current = await _read_one(js, endpoint, job_id, by)
        if current is None:
            return None
        admitted, revision = current
        changed = change(admitted)
        if changed is None:
            return admitted
        try:
            await js.publish(
                subject(endpoint, job_id, by),
                changed.encode(),
                headers={_EXPECTED_LAST: str(revision)},
                msg_ttl=_ttl(changed, time.time()),
            )
        except APIError as exc:
            if exc.err_code == WRONG_LAST_SEQUENCE:
                continue
            raise
        return changed
