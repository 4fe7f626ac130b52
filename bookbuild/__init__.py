"""The book's build: executes the chapters (papermill), writes the generated pages (claims ledger, build
status, workshop), renders the HTML and the PDF, and checks the book on a GPU and under another CPU
kernel set. It imports `labutils`, the chapters' helpers; `labutils` never imports it."""
