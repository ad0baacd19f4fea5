"""Helpers the test suite shares: tiny models and tokenizers, reference implementations, drivers."""
