"""The OpenAI wire format: request bodies and their fields, the route handlers, chat and text rendering, images."""
