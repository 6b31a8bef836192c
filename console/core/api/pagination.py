from rest_framework.pagination import PageNumberPagination


class StandardPagination(PageNumberPagination):
    """Every list is paginated: ``?page=N&page_size=M`` (at most 500)."""

    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 500
