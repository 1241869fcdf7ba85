"""The reference GPT trainer: a small Llama-style model trained under any mix of pipeline, data,
expert, context and tensor parallelism, checkpointing through anyshard so a run can resume under
another layout. The library never imports this subpackage."""
