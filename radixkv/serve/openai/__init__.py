"""The OpenAI layer of the serving tier: OpenAI's HTTP API over any engine client, torch-free.

The request shapes (:mod:`~radixkv.serve.openai.protocol`), the response shapes
(:mod:`~radixkv.serve.openai.responses`), errors (:mod:`~radixkv.serve.openai.errors`),
request bodies (:mod:`~radixkv.serve.openai.bodies`), the OpenAPI document's bodies
(:mod:`~radixkv.serve.openai.openapi`), a request's choices
(:mod:`~radixkv.serve.openai.choices`), the request handling
(:mod:`~radixkv.serve.openai.handlers`) over an engine client and the records it reads from
an engine (:mod:`~radixkv.serve.openai.client`), Prometheus text
(:mod:`~radixkv.serve.openai.metrics`). It imports the engine's torch-free records and the
text tier only, so the Ray ingress serves it without torch (``tests/test_layout.py``).
"""
