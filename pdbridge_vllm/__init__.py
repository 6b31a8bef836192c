"""pdbridge's vLLM KV connector: runs inside vLLM's processes, imports neither Django nor the agent."""
