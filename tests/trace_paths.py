"""Where the shared Mooncake traces live: ``../shared/data/traces`` beside the checkout
(CI's layout), or the folder named by ``$RADIXKV_TRACES``."""

import os
from pathlib import Path

TRACES = Path(
    os.environ.get("RADIXKV_TRACES")
    or Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"
)
