"""`python -m jaxrag.datastore inspect|audit|add|remove|relabel DIR ...`: audit and edit an SR-RAG
policy datastore. The implementation lives in `jaxrag.retrieval.datastore(_cli)`."""

import sys

from jaxrag.retrieval.datastore_cli import main

if __name__ == "__main__":
    sys.exit(main())
