"""Batches: OpenAI's Batch API (``/v1/files`` + ``/v1/batches``) and RunPod's batch jobs
(``/v2/{endpoint}/batch``) over the job queue's lowest lane.

- ``limits``: what a batch, a file, a key may hold (the settings both front doors read);
- ``jsonl``: an OpenAI batch input file, validated line by line (pure);
- ``record``: a batch's record and its state machine, and how each API shows it (pure);
- ``output``: the output and error files' lines (pure);
- ``runpod``: RunPod's batch request and response shapes (pure);
- ``files``: a stored file's record and the upload's fields (pure);
- ``estimate``: will a batch finish inside its window, at the rate it goes (pure);
- ``store``: where files and batch records live (the protocol; a local-disk store here, the
  NATS one in ``llmendpoints_common.queue.batch_store``);
- ``api``: the HTTP verbs, framework-free, for both front doors;
- ``driver``: what moves a batch from ``validating`` to ``completed``.

No web framework, no engine here.
"""
