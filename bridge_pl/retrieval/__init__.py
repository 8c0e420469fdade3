"""Retrievers (the plug-in point), FAISS indexes, and Plackett-Luce sampling / LM-supervised credit."""
