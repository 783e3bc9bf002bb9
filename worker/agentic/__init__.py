"""Multi-turn episodes of GRPO jobs (docs/agentic.md): what answers a model's turn (tools,
an OpenEnv environment) as Episode objects, one per row of a step. The decode of the turns is
worker/decode/episodes.py."""
