"""Router: public API, replica choice, the gamma policy, Redis state (issue 5)."""
