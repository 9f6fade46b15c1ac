"""Serving: the Serve application (`app`), the OpenAI front end (`ingress`, `protocol`, `text`) and the decoder
deployment whose replicas are units (`decoder`)."""
