"""Every limit on what one request may carry, in one place. Each list or string a request brings is
bounded here and checked on its raw length before any work proportional to it (the server's
decoder checks the HTTP body's lists as it reads them: serving/protocol.py); the README's table of
limits quotes these. A limit is OpenAI's where it has one."""

from __future__ import annotations

MAX_N = 128  # samples per request: each is a sequence in the batch, and they are added at once
# sequences one request may queue (prompts x n): OpenAI takes up to 2,048 prompts in one request
MAX_SEQUENCES = 2048
MAX_STOP = 64  # stop strings, and stop token ids, per request: each generated token is checked against them
MAX_STOP_CHARS = 1024  # streaming holds back up to this many characters (a stop string may be starting)
MAX_LOGIT_BIAS = 300  # logit_bias entries per request: the width of the step's bias table (batch.py)
# allowed_token_ids per request: the largest vocabularies served (Gemma 3: 262,144 ids)
MAX_ALLOWED_TOKEN_IDS = 262_144
# allowed_token_ids x sequences of one request: every sequence carries the set to the engine core
# and builds its mask there, so a request of many prompts with a large set is split by its client
MAX_ALLOWED_TOKEN_IDS_TOTAL = 1 << 22
MAX_GRAMMAR_CHARS = 256 * 1024  # a schema, regex, grammar or choice list longer than this is refused
MAX_CHOICES = 4096  # structured_outputs.choice alternatives (each compiled into the grammar)
MAX_TOOLS = 128  # tools per chat request (OpenAI's limit)
MAX_MESSAGES = 8192  # messages per chat request (rendered by the chat template one by one)
MAX_REQUEST_ID_CHARS = 256  # a request id is echoed into every chunk and log line
MAX_DETOKENIZE_IDS = 1 << 20  # token ids one /detokenize request may carry
MAX_UNKNOWN_FIELDS_LOGGED = 16  # ignored field names named in the log line of one request
