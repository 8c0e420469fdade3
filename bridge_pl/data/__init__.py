"""QA sets and corpora: readers, the packaged real data, and the built-in synthetic world."""
