"""Control plane: a tiny continuous-batching inference engine that takes live weight updates.

A request flows `LLMEngine.add_request` -> `Scheduler.schedule` (continuous batching under a token
budget, KV blocks from the `BlockManager`) -> `ModelRunner.execute` (one forward pass over every
scheduled token, then sampling) -> postprocessing (stop checks, per-token weight versions) ->
`RequestOutput`. `AsyncEngine` drives the same loop from asyncio and streams outputs, while
`pause_generation`, `resume_generation` and `update_weights` stay responsive between steps.
"""
