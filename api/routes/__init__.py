"""One router per resource; api/main.py includes them."""
