"""peers/api: an OpenAI-compatible HTTP server (``swarm api``) and the generation engine it shares with ``swarm chat``.

- ``errors.py``: ``ApiError``, OpenAI's error object and its HTTP status.
- ``schemas.py``: the request bodies of ``/v1/completions`` and ``/v1/chat/completions``, checked.
- ``chat_template.py``: messages -> prompt text (the model's Jinja chat template, else a plain fallback).
- ``stops.py``: text out of tokens, as it comes: whole characters only, cut at stop strings.
- ``engine.py``: one shared ``SwarmClient``; each request its own inference session on the peers.
- ``sse.py``: server-sent events framing; ``responses.py``: OpenAI's response and chunk objects.
- ``app.py``: the aiohttp application: routes, API key, errors.
"""
