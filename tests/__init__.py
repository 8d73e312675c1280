"""The test suite never reaches the Hugging Face hub: hub ids resolve from local caches only.

Set here, before anything imports huggingface_hub (it reads the variable once, on import); a
developer who exports HF_HUB_OFFLINE=0 on purpose keeps their choice.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
