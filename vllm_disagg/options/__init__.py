"""One options layer for the P2P connector, the router and step sync: rows
(``rows.py``), the shared value parsers with one refusal wording
(``parsers.py``), and the docs tables rendered from the rows (``tables.py``)."""
