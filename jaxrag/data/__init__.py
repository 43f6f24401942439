"""What real data needs: the shared QA schema (`schema`), the ten datasets' loaders (`loaders`),
Table 5's training mixture (`mixture`), the checks before the first stage (`check`), and
Algorithm 1, which turns questions into training records (`construct*.py`)."""
