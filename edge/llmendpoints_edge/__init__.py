"""The HTTP edge both front doors share: the runtime's (one pod) and the gateway's (many).

Everything a request meets before a component's own routes decide anything lives here once:

- ``settings``: ``EdgeSettings``, every environment variable the two share (one name, one
  default each); ``RuntimeSettings`` and ``GatewaySettings`` extend it;
- ``server``: uvicorn with a SIGTERM drain over a ``busy()/start_draining()`` protocol, and the
  HTTP protocol that bounds request headers in time and size (408 / 431, closed);
- ``keys``: API keys from headers, key files re-read when they change (failing closed);
- ``body``: the request body read once, within a deadline and a size limit, checked for UTF-8,
  object-ness and nesting depth, and handed on;
- ``paths``: request paths normalised once (dot segments, ``//``, percent-encoded dots);
- ``asgi``: request ids, error answers in OpenAI's shape;
- ``logs``: text lines that escape every client-supplied value, or JSON lines, never buffered.

It imports ``llmendpoints_common`` and uvicorn, never a web framework, vLLM, or a deployable
(an import-linter contract in pyproject.toml keeps it so).
"""
