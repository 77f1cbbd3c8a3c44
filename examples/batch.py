"""A batch with the openai SDK, end to end: upload, create, wait, read the answers.

    # against `make serve` (one pod, no queue) or a gateway with the shared queue:
    python examples/batch.py --base-url http://127.0.0.1:8000/v1 --model demo
    python examples/batch.py --base-url http://127.0.0.1:8080/v1 --api-key sk-... --model demo

docs/batch.md explains the file, the statuses and the answers.
"""

from __future__ import annotations

import argparse
import io
import json
import time

import openai


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--requests", type=int, default=20)
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)

    lines = [
        {
            "custom_id": f"question-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": args.model,
                "messages": [{"role": "user", "content": f"Say something about {i}."}],
                "max_tokens": 32,
            },
        }
        for i in range(args.requests)
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("questions.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"example": "examples/batch.py"},
    )
    print(f"batch {batch.id}: {batch.status}")
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(1)
        batch = client.batches.retrieve(batch.id)
        counts = batch.request_counts
        print(
            f"  {batch.status}: {counts.completed} done, {counts.failed} failed of {counts.total}"
        )
    if batch.status == "failed":
        for error in batch.errors.data:
            print(f"  line {error.line}: {error.code}: {error.message}")
        return
    if batch.output_file_id:
        for raw in client.files.content(batch.output_file_id).text.splitlines():
            line = json.loads(raw)
            message = line["response"]["body"]["choices"][0]["message"]["content"]
            print(f"{line['custom_id']}: {message!r}")
    if batch.error_file_id:
        print(client.files.content(batch.error_file_id).text)
    print(f"tokens: {batch.usage.input_tokens} in, {batch.usage.output_tokens} out")


if __name__ == "__main__":
    main()
