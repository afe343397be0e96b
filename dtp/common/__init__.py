"""What every chapter stands on: gloo worlds of several processes (`world`, `processes`), recording
what a rank sends and receives (`traffic`), the course's models (`gpt`: the GPT the memory,
tensor-parallel, ZeRO and topology chapters build; `models`: small seeded models and data), and
build-time measurements of this machine (`measure`)."""
