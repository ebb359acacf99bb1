"""The engine: the core loop (scheduler + model runner, token ids in and out), the clients that run
one or several cores, and the front end (tokenizing, detokenizing, stop strings, n > 1 groups, LLM)."""
