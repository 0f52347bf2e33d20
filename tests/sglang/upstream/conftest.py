"""SGLang's test files in ``files/`` run through ``test_upstream.py`` only (with cpkv's classes put in): pytest
does not collect them as they are."""

collect_ignore_glob = ["files/*"]
