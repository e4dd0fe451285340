"""``python -m router``: see router.server.build_parser for the options."""
from router.server import main

if __name__ == "__main__":
    main()
