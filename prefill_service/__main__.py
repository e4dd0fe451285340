"""``python -m prefill_service``: run a prefill worker."""
import sys

from prefill_service.server import main

sys.exit(main())
