from django import forms
from django.contrib import admin, messages

from console.core.models import ApiToken, AuditLog
from console.core.services_tokens import api_token_issue, api_token_revoke


@admin.register(AuditLog)
class AuditLogAdmin(admin.ModelAdmin):
    list_display = [
        "created_at",
        "actor_label",
        "action",
        "verb",
        "object_type",
        "object_id",
        "object_repr",
    ]
    list_filter = ["action", "object_type"]
    search_fields = ["actor_label", "object_repr", "object_id", "request_id"]
    readonly_fields = [f.name for f in AuditLog._meta.fields]

    def has_add_permission(self, request):  # the log is written by services only
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class ApiTokenAddForm(forms.ModelForm):
    """Issue a token: whose, and what it is for (the key itself is generated)."""

    class Meta:
        model = ApiToken
        fields = ["user", "name"]


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """Users' API tokens: browse (prefix, never the token or its hash), issue (the token is
    shown once, in the confirmation message), revoke (delete). Writes go through
    ``console.core.services_tokens``, so they are audited."""

    form = ApiTokenAddForm
    list_display = ["user", "name", "token_prefix", "created_at", "created_by"]
    list_select_related = ["user", "created_by"]
    list_filter = ["created_at"]
    search_fields = ["user__username", "name", "token_prefix"]

    def has_change_permission(self, request, obj=None):  # a token is issued or revoked only
        return False

    def save_model(self, request, obj, form, change):
        row, token = api_token_issue(
            actor=request.user, user=form.cleaned_data["user"], name=form.cleaned_data["name"]
        )
        obj.pk = row.pk
        obj._state.adding = False
        self.message_user(
            request,
            f"API token for {row.user.get_username()}: {token} -- copy it now: only its hash "
            "is stored, it cannot be shown again.",
            messages.WARNING,
        )

    def save_related(self, request, form, formsets, change):
        """Nothing else to save: the service wrote the row."""

    def delete_model(self, request, obj):
        api_token_revoke(actor=request.user, token=obj)

    def delete_queryset(self, request, queryset):
        for token in queryset.select_related("user"):
            api_token_revoke(actor=request.user, token=token)
