"""`python -m decode_service`: run a decode worker (see decode_service/server.py)."""
import sys

from decode_service.main import main

sys.exit(main())
